"""A script job's executor: `python train.py ARGS` run unchanged in this process, as its caller.

The executor has become the caller (uid, groups, working directory: `Become`); `Script` adds
the caller's environment and arguments. With a client (`salusd run`) the client's own stdin,
stdout and stderr descriptors arrive on its socket and become this process's 0, 1 and 2, so
the script writes to the caller's terminal as a direct run does (C output and child processes
too, in order) and reads the caller's stdin; a byte `I` on that socket is a Ctrl-C, raised in
the script as SIGINT. Without a client (REST) stdin is empty and both streams go, through a
pipe, to the job's log (bounded and rotated, `salusd/state/job_output.py`).

Iteration boundaries (`Boundaries`): every `torch.optim.Optimizer.step()` (a global step post
hook; `SALUS_BOUNDARY=explicit` turns it off) and every `salus.step()`. The script's run between
two boundaries is one of the job's iterations, scheduled as a direct call is: while the job
holds its lane's lease it goes on at once and what ran is reported in batches (`Ran`);
otherwise the executor asks (`Ready`) and waits for `Run`, and answers it with `CallDone` at
the next boundary. The code before the first boundary is the first iteration; what follows the
last one is not an iteration (a script without a boundary is one iteration). Daemon messages
are read only at boundaries, so a suspend, a cancel or another job's turn takes effect there.

When the script ends the executor reports its exit status (`Exited`: 0, `sys.exit`'s code, 1
for an uncaught exception, 130 for an uncaught KeyboardInterrupt) to the daemon and the client.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import io
import json
import logging
import os
import random
import runpy
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from salus.adapters.torch import script as api
from salus.daemon.executor import interpreter
from salus.daemon.executor.output import OutputSink
from salus.daemon.executor.peak import PeakMeter
from salus.daemon.wire.channel import Channel, ConnectionClosed
from salus.daemon.wire.executor_ops import (
    Ack,
    CallDone,
    EstimateFailed,
    Exit,
    Exited,
    Failed,
    Lease,
    Progress,
    Ran,
    Ready,
    Refuse,
    Reply,
    Run,
    Script,
    client_frame_follows,
    decode_request,
    encode,
)

log = logging.getLogger("salusd.executor")
REPORT_EVERY_S = 0.02  # leased iterations are reported in batches this often (as direct calls)
STDIO_WAIT_S = 10.0  # the client sends its descriptors right after it connects
INTERRUPT = b"I"  # client -> executor: the caller pressed Ctrl-C
NO_ESTIMATE = ("a script job's iterations run in its own process and are measured as they run, "
               "not estimated on fake tensors")


@dataclass(frozen=True)
class Command:
    """What the interpreter was asked to run: a script `path` or a `module` (`-m`), its
    arguments, and whether output is unbuffered (`-u`, or `PYTHONUNBUFFERED`)."""

    path: str | None
    module: str | None
    args: tuple[str, ...]
    unbuffered: bool


def parse_command(argv: tuple[str, ...], env: dict[str, str]) -> Command:
    """`train.py ARGS`, `-u train.py ARGS` or `-m module ARGS`; ValueError for anything else
    (salusd runs scripts, not an interactive interpreter)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    rest = list(argv)
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    usage = "salusd runs `python [-u] SCRIPT ARGS...` or `python [-u] -m MODULE ARGS...`"
    if not rest:
        raise ValueError(f"no script to run: {usage}")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise ValueError(f"-m needs a module name: {usage}")
        return Command(None, rest[1], tuple(rest[2:]), unbuffered)
    if rest[0].startswith("-"):
        raise ValueError(f"the interpreter option {rest[0]!r} is not supported: {usage}")
    return Command(rest[0], None, tuple(rest[1:]), unbuffered)


class Boundaries:
    """The daemon's side of a running script: its turn in the lane at each boundary."""

    def __init__(self, daemon: Channel, estimate: bool) -> None:
        self.daemon = daemon
        self.pid = os.getpid()  # a process the script forked has no turn to ask for
        self.lock = threading.RLock()
        self.meter = PeakMeter()
        self.lease = False
        self.asked = False
        self.granted = False  # a `Run` was received: its `CallDone` is sent at the boundary
        self.estimate = estimate  # the first `Ready` says why there is no estimate
        self.seen = 0  # boundaries so far
        self.began = time.monotonic()
        self.ran: _Ran | None = None

    def start(self) -> None:
        """Before the script's first line: wait for the job's first turn."""
        self.meter.set_baseline()
        with self.lock, _stopping():
            self._wait_turn()
            self._begin()

    def boundary(self) -> None:
        """An iteration ended: report it, then go on at once under a lease, or wait for the
        job's next turn."""
        if os.getpid() != self.pid:
            return
        with self.lock, _interrupts_deferred(), _stopping():
            self.seen += 1
            self._end(counted=True)
            self._poll()
            self._wait_turn()
            self._begin()

    def progress(self, step: int, max_steps: int | None, loss: float | None) -> None:
        if os.getpid() == self.pid:
            with self.lock:
                self._send(Progress(step, max_steps, loss))

    def exited(self, code: int) -> None:
        """The script ended with exit status `code`: report its last part and the status."""
        with self.lock:
            self._end(counted=self.seen == 0)
            self._report_ran()
            self._send(Exited(code))

    def drain(self) -> None:
        """Answer the daemon until it says `exit`."""
        with self.lock:
            while True:
                try:
                    self._handle(self.daemon.recv())
                except (ConnectionClosed, OSError, _Stop):
                    return

    # ---- the turn protocol ----------------------------------------------------------------
    def _begin(self) -> None:
        self.began = time.monotonic()
        self.meter.start()

    def _end(self, counted: bool) -> None:
        ended = time.monotonic()
        seconds, peak = ended - self.began, self.meter.peak()
        if self.granted:
            self.granted = False
            self._send(CallDone(True, seconds, peak, counted, self.began, ended))
        elif self.lease:
            if self.ran is None:
                self.ran = _Ran(ended, self.began)
            self.ran.add(counted, seconds, peak, ended)
            if ended - self.ran.since >= REPORT_EVERY_S:
                self._report_ran()

    def _poll(self) -> None:
        """Handle what the daemon sent while the iteration ran (without waiting)."""
        sock = self.daemon.sock
        while self.daemon.buffered() or select.select([sock], [], [], 0)[0]:
            self._report_ran()  # the daemon decides knowing what ran
            self._handle(self.daemon.recv())

    def _wait_turn(self) -> None:
        while not (self.lease or self.granted):
            if not self.asked:
                self.asked = True
                estimate = EstimateFailed(NO_ESTIMATE) if self.estimate else None
                self.estimate = False
                self._send(Ready(True, estimate))
            self._report_ran()
            self._handle(self.daemon.recv())

    def _handle(self, meta: Any) -> None:
        """One daemon message; a frame that follows it (none is sent to a script job) is read
        and dropped so the stream stays in step."""
        if client_frame_follows(meta):
            self.daemon.recv()
        try:
            message = decode_request(meta)
        except ValueError as exc:
            self._send(Failed(str(exc)[:2000]))
            return
        match message:
            case Exit():
                raise _Stop(message.message)
            case Lease(granted=granted):
                self.lease = granted
                self._send(Ack())
            case Run():
                self.asked = False
                if self.lease:  # it went on under a lease granted meanwhile: nothing to run
                    self._send(CallDone(False, 0.0, None, False, None, None, empty=True))
                else:
                    self.granted = True
            case Refuse(message=text):
                self._send(Ack())
                raise _Stop(text)
            case Script():
                self._send(Failed("this executor already runs a script"))
            case _ if message.op in ("place", "swap_out"):
                # The script owns its tensors and device: nothing is placed or moved for it.
                self._send(Ack())
            case _:
                self._send(Failed(f"a script job cannot {message.op!r}: it keeps its own "
                                  "state (checkpoints: salus.resume_dir())"))

    def _report_ran(self) -> None:
        if self.ran is not None:
            ran, self.ran = self.ran, None
            self._send(ran.report())

    def _send(self, reply: Reply) -> None:
        self.daemon.send(encode(reply))


class _Stop(BaseException):
    """The daemon ended the job (cancel, shutdown): the script stops here."""


@contextlib.contextmanager
def _stopping() -> Iterator[None]:
    """A job the daemon ended while its script ran stops at this boundary: its process
    exits (the daemon already knows why)."""
    try:
        yield
    except (_Stop, ConnectionClosed) as stop:
        _flush()
        log.info("script stopped: %s", stop)
        os._exit(1)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """A Ctrl-C that comes during a boundary reaches the script when the boundary returns (as
    if it came in the optimizer step), never in the middle of a message to the daemon."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, _: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if pending and callable(handler):
        handler(signal.SIGINT, None)
    elif pending and handler == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)


class _Ran:
    """Iterations run under the lease since the last `Ran`."""

    def __init__(self, since: float, began: float) -> None:
        self.since = since
        self.began = self.ended = began
        self.calls = self.iterations = 0
        self.seconds = 0.0
        self.peak: int | None = None

    def add(self, counted: bool, seconds: float, peak: int | None, ended: float) -> None:
        self.calls += 1
        self.iterations += counted
        self.seconds += seconds if counted else 0.0
        if peak is not None:
            self.peak = max(self.peak or 0, peak)
        self.ended = ended

    def report(self) -> Ran:
        return Ran(self.calls, self.iterations, 0, self.seconds, self.peak, self.began,
                   self.ended)


# ---- the process becomes the script's ---------------------------------------------------------
def run(daemon: Channel, message: Script, request: Any, estimate: bool,
        log_path: str | None) -> bool:
    """Run the script of `message` (the client's socket in `request`, when it has one) to its
    end; False when it could not start (the daemon was told why), True once it ran."""
    fd = request.get("socket_fd") if isinstance(request, dict) else None
    client = socket.socket(fileno=fd) if isinstance(fd, int) else None
    env = _caller_env(message)
    try:
        command = parse_command(message.argv, message.env)
        if client is None and message.frame is not False:
            raise ValueError("the script's client sent no socket")
        python = interpreter.resolve(message.interpreter, env)
        if interpreter.elsewhere(python, env) and not daemon.buffered():
            state = {"daemon": daemon.sock.fileno(), "client": fd, "script": encode(message),
                     "threads": torch.get_num_threads(), "estimate": estimate, "log": log_path}
            interpreter.become(python, state, [daemon.sock.fileno(), *([fd] if fd else [])],
                               env)
        stdio = _client_stdio(client) if client is not None else None
    except (ValueError, OSError) as exc:
        if client is not None:
            client.close()
        daemon.send(encode(Failed(str(exc)[:2000])))
        return False
    daemon.send(encode(Ack()))
    restore_log = _keep_daemon_log()
    pump = _pump_to_log(log_path, restore_log) if stdio is None else None
    if stdio is not None:
        _install_stdio(stdio)
    _make_streams(command.unbuffered)
    _become_the_script(message, command)
    boundaries = Boundaries(daemon, estimate)
    if message.env.get(api.BOUNDARY_ENV) != "explicit":
        register_optimizer_step_post_hook(lambda *_: boundaries.boundary())
    api.install(boundaries.boundary, boundaries.progress)
    if client is not None:
        threading.Thread(target=_interrupts, args=(client,), daemon=True).start()
    boundaries.start()
    code = _execute(command)
    _wind_down()
    if pump is not None:
        pump()
    boundaries.exited(code)
    _tell_client(client, code)
    boundaries.drain()
    return True


def _client_stdio(client: socket.socket) -> list[int]:
    """The client's stdin, stdout and stderr descriptors, sent on its socket."""
    client.settimeout(STDIO_WAIT_S)
    try:
        _, fds, _, _ = socket.recv_fds(client, 16, 3)
    except TimeoutError:
        raise ValueError("the client sent no stdin, stdout and stderr") from None
    client.settimeout(None)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"the client sent {len(fds)} descriptors, not its stdin, stdout and "
                         "stderr")
    return fds


def _install_stdio(fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)


def _keep_daemon_log() -> TextIO:
    """The executor's own log records keep going where they went (the daemon's stderr), not
    into the script's stderr."""
    stream = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    handlers = [h for logger in (logging.getLogger(), logging.getLogger("salusd"))
                for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    for handler in handlers:
        handler.setStream(stream)
    if not handlers:  # in the caller's interpreter (interpreter.py): none was set up yet
        handler = logging.StreamHandler(stream)
        handler.setLevel(logging.WARNING)
        logging.getLogger("salusd").addHandler(handler)
    return stream


def _pump_to_log(path: str | None, fallback: TextIO) -> Callable[[], None] | None:
    """Without a client: stdin is empty, and fds 1 and 2 are one pipe whose lines go to the
    job's log file (`path`; None: the daemon's log, where they went before). Returns what
    waits for the pipe's last lines once the script is done."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if path is None:
        return None
    sink = OutputSink(path, {"stdout": fallback, "stderr": fallback})
    read, write = os.pipe()
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        with open(read, "rb", buffering=0) as pipe:
            partial = b""
            while chunk := pipe.read(65536):
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    sink.line("stdout", line.decode("utf-8", "replace") + "\n")
            if partial:
                sink.line("stdout", partial.decode("utf-8", "replace"))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()

    def drain() -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
        thread.join(2.0)  # what the script's own children still write is not waited for

    return drain


def _make_streams(unbuffered: bool) -> None:
    """`sys.stdin`, `sys.stdout`, `sys.stderr` over fds 0-2, buffered as the interpreter
    makes them: stdout line-buffered on a terminal and in blocks otherwise, stderr by lines,
    both written through with `-u`."""
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                 line_buffering=True)
    sys.stdout = _writer(1, unbuffered, os.isatty(1), "strict")
    sys.stderr = _writer(2, unbuffered, True, "backslashreplace")


def _writer(fd: int, unbuffered: bool, lines: bool, errors: str) -> TextIO:
    raw = io.FileIO(fd, "w", closefd=False)
    size = os.fstat(fd).st_blksize
    binary = raw if unbuffered else io.BufferedWriter(raw, size if size > 1 else 8192)
    return io.TextIOWrapper(binary, errors=errors,
                            line_buffering=lines or unbuffered, write_through=unbuffered)


def _become_the_script(message: Script, command: Command) -> None:
    """The caller's environment, argv, import path, signals and fresh random seeds (a forked
    executor would otherwise repeat the zygote's streams)."""
    env = _caller_env(message)
    os.environ.clear()
    os.environ.update(env)
    first = (os.path.dirname(os.path.abspath(command.path)) if command.path is not None
             else os.getcwd())
    extra = [p for p in message.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:1] = [first, *extra]
    sys.argv = [command.path or command.module or "", *command.args]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)  # the zygote's, closed in this process: a signal would write there
    random.seed()
    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _caller_env(message: Script) -> dict[str, str]:
    """The script's environment: who `Become` made the executor, then the caller's own, and
    the job's resume directory."""
    who = {k: os.environ[k] for k in ("HOME", "USER", "LOGNAME") if k in os.environ}
    resume = {} if message.resume_dir is None else {api.RESUME_ENV: message.resume_dir}
    return {**who, **message.env, **resume}


def _execute(command: Command) -> int:
    """Run the script as `__main__`: its exit status."""
    try:
        if command.module is not None:
            runpy.run_module(command.module, run_name="__main__", alter_sys=True)
        else:
            assert command.path is not None
            _run_path(command.path)
    except SystemExit as exc:
        return _exit_status(exc.code)
    except BaseException as exc:
        _print_exception(exc)
        return 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _run_path(path: str) -> None:
    """Run the file at `path` as the interpreter runs a script: as module `__main__` (so that
    its classes pickle by reference to it), `__file__` absolute, `sys.argv[0]` as typed."""
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _exit_status(code: object) -> int:
    """As the interpreter turns `sys.exit(code)` into a status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_exception(exc: BaseException) -> None:
    """The traceback as a direct run prints it: from the script's own frames."""
    tb = exc.__traceback__
    ours = {__file__, runpy.__file__}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def _wind_down() -> None:
    """What the interpreter does at exit: wait for the script's threads, run its `atexit`
    functions, flush the streams."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    _flush()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _interrupts(client: socket.socket) -> None:
    """Raise SIGINT in the script for each Ctrl-C the client forwards."""
    while True:
        try:
            data = client.recv(64)
        except OSError:
            return
        if not data:
            return
        for _ in range(data.count(INTERRUPT)):
            os.kill(os.getpid(), signal.SIGINT)


def _tell_client(client: socket.socket | None, code: int) -> None:
    if client is None:
        return
    with contextlib.suppress(OSError):  # the client went away; the daemon knows the status
        client.sendall(json.dumps({"exit": code}).encode() + b"\n")
