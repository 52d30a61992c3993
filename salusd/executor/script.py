"""A script job's executor: `python train.py ARGS` run unchanged in this process, as its caller.

The executor has become the caller (uid, groups, working directory: `Become`); `Script` adds
the caller's environment and arguments. With a client (`salusd run`) the client's own stdin,
stdout and stderr descriptors arrive on its socket and become this process's 0, 1 and 2, so
the script writes to the caller's terminal as a direct run does (C output and child processes
too, in order) and reads the caller's stdin; a byte `I` on that socket is a Ctrl-C, raised in
the script as SIGINT, and `T`, `H`, `1`, `2` are SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 sent to
`salusd run`, raised in the script (never in the middle of a boundary's exchange with the
daemon: they wait for the boundary's lock). Without a client (REST) stdin is empty and both
streams go, through a pipe, to the job's log (bounded and rotated, `salusd/state/job_output.py`).

Its iteration boundaries are `boundaries.py`'s: every optimizer step and `salus.step()`; the
code before the first boundary is the first iteration, what follows the last one is not an
iteration (a script without a boundary is one iteration).

This module and what it imports need only the standard library, so that it runs in an interpreter
whose environment has neither torch nor salusd (`salusd/supervisor/zygotes.py` puts salusd on its
path): what it does to torch (the optimizer-step hook, the intra-op thread count, the
device cap, a fresh seed) is done when torch is imported, by the zygote or by the script
(`on_import.py`). A script that never imports torch has no optimizer-step boundaries; it may
mark its own with `salus.adapters.script.step()`, and otherwise runs as one iteration.

When the script ends the executor reports its exit status (`Exited`: 0, `sys.exit`'s code, 1
for an uncaught exception, 130 for an uncaught KeyboardInterrupt) to the daemon, and to the
client once the daemon lets the job go, unless the command runs again (`--restart
on-failure`): then the client's socket goes to the rerun's executor, which asks the client for
its stdin, stdout and stderr again (`Script.restart`).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
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
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO

from salus.daemon.executor import interpreter, process
from salus.daemon.executor.boundaries import Boundaries, flush
from salus.daemon.executor.in_pod import InPodChannel
from salus.daemon.executor.on_import import imported, when_imported
from salus.daemon.executor.output import OutputSink
from salus.daemon.wire import script_hooks as api
from salus.daemon.wire.executor_ops import RESTARTING, Ack, Failed, Script, addressed, encode
from salus.daemon.wire.frames import passed_fd
from salus.daemon.wire.json_channel import JsonChannel

if TYPE_CHECKING:
    from salus.daemon.wire.channel import Channel

log = logging.getLogger("salusd.executor")
STDIO_WAIT_S = 10.0  # the client sends its descriptors right after it connects
SIGNAL_SETTLE_S = 0.005  # a forwarded signal's handler runs within this (between bytecodes)
INTERRUPT = b"I"  # client -> executor: the caller pressed Ctrl-C
SIGNALS = {INTERRUPT[0]: signal.SIGINT, ord("T"): signal.SIGTERM, ord("H"): signal.SIGHUP,
           ord("1"): signal.SIGUSR1, ord("2"): signal.SIGUSR2}  # client -> executor
STDIO_AGAIN = b'{"stdio": true}\n'  # executor -> client: a rerun asks for the descriptors


@dataclass(frozen=True)
class Command:
    """What the interpreter was asked to run: a script `path`, a `module` (`-m`) or the
    program text `code` (`-c`), its arguments, and whether output is unbuffered (`-u`, or
    `PYTHONUNBUFFERED`)."""

    path: str | None
    module: str | None
    args: tuple[str, ...]
    unbuffered: bool
    code: str | None = None

    @property
    def argv0(self) -> str:
        """`sys.argv[0]` as the interpreter sets it before the script runs (`-c` for code;
        `runpy` sets a module's to its file)."""
        return "-c" if self.code is not None else self.path or self.module or ""


def parse_command(argv: tuple[str, ...], env: dict[str, str]) -> Command:
    """`train.py ARGS`, `-m module ARGS` or `-c CODE ARGS`, each after any `-u`; ValueError
    for anything else (salusd runs programs, not an interactive interpreter)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    rest = list(argv)
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    usage = ("salusd runs `python [-u] SCRIPT ARGS...`, `python [-u] -m MODULE ARGS...` or "
             "`python [-u] -c CODE ARGS...`")
    if not rest:
        raise ValueError(f"no script to run: {usage}")
    if rest[0] in ("-m", "-c"):
        if len(rest) < 2:
            raise ValueError(f"{rest[0]} needs " + ("a module name" if rest[0] == "-m" else
                                                    "the program's text") + f": {usage}")
        if rest[0] == "-c":
            return Command(None, None, tuple(rest[2:]), unbuffered, code=rest[1])
        return Command(None, rest[1], tuple(rest[2:]), unbuffered)
    if rest[0].startswith("-"):
        raise ValueError(f"the interpreter option {rest[0]!r} is not supported: {usage}")
    return Command(rest[0], None, tuple(rest[1:]), unbuffered)


# ---- the process becomes the script's ---------------------------------------------------------
def run(daemon: Channel | JsonChannel, message: Script, request: Any, job: int, estimate: bool,
        log_path: str | None, cwd: str | None) -> bool:
    """Run the script of job `job`'s `message` (the client's socket in `request`, when it has
    one) in directory `cwd` to its end; False when it could not start (the daemon was told
    why), True once it ran."""
    fd = passed_fd(request)
    client = None if fd is None else socket.socket(fileno=fd)
    env = _caller_env(message)
    try:
        command = parse_command(message.argv, message.env)
        _enter(cwd)
        if client is None and message.frame is not False:
            raise ValueError("the script's client sent no socket")
        python = interpreter.resolve(message.interpreter, env)
        if interpreter.elsewhere(python, env):
            if daemon.buffered():  # the daemon spoke before the script started: it ended it
                raise ValueError("the job ended before its script started")
            state = {"daemon": daemon.sock.fileno(), "client": fd, "script": encode(message),
                     "job": job, "threads": process.threads(), "estimate": estimate,
                     "log": log_path, "cwd": cwd, "in_pod": isinstance(daemon, InPodChannel)}
            interpreter.become(python, state, [daemon.sock.fileno(),
                                               *([] if fd is None else [fd])], env)
        stdio = _client_stdio(client, message.restart > 0) if client is not None else None
    except (ValueError, OSError) as exc:
        if client is not None:
            client.close()
        daemon.send(addressed(encode(Failed(str(exc)[:2000])), job))
        return False
    daemon.send(addressed(encode(Ack()), job))
    daemon_log = _keep_daemon_log()
    pump = _pump_to_log(log_path, daemon_log) if stdio is None else None
    if stdio is not None:
        _install_stdio(stdio)
    _make_streams(command.unbuffered)
    daemon_gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")  # the daemon's, by UUID
    _become_the_script(message, command, cwd)
    boundaries = Boundaries(daemon, job, estimate)
    boundaries.pin = (message.env.get("CUDA_VISIBLE_DEVICES"), daemon_gpus)
    signal.signal(signal.SIGINT, boundaries.on_sigint)
    automatic = message.env.get(api.BOUNDARY_ENV) != "explicit"

    def hook_optimizers(torch: ModuleType) -> None:
        optimizer = importlib.import_module("torch.optim.optimizer")  # torch imported it
        optimizer.register_optimizer_step_post_hook(
            lambda opt, *_: boundaries.stepped(opt, automatic))

    when_imported("torch", hook_optimizers)  # now, or as the script imports torch
    api.install(boundaries.boundary, boundaries.progress)
    stop_interrupts = (_forward_signals(client, boundaries.lock) if client is not None
                       else None)
    if isinstance(daemon, InPodChannel):  # salusd cannot signal or kill it: it tells it
        daemon.watch()
    boundaries.start()
    code = _execute(command)
    if isinstance(daemon, InPodChannel):
        daemon.over = True
    _wind_down()
    if pump is not None:
        pump()
    if stop_interrupts is not None:  # before the daemon may hand the client to a rerun
        stop_interrupts()
    boundaries.exited(code)
    if boundaries.drain() != RESTARTING:  # a rerun tells the client its own status
        _tell_client(client, code)
    return True


def _client_stdio(client: socket.socket, ask: bool) -> list[int]:
    """The client's stdin, stdout and stderr descriptors, sent on its socket (once unasked,
    right after it connects; `ask`: a rerun asks for them again)."""
    if ask:
        client.sendall(STDIO_AGAIN)
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
    """The executor's own log records keep going where they went (the zygote's output pipe,
    whose lines the daemon logs as executor output: `zygotes.OutputRelay`), not into the
    script's stderr."""
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
    job's log file (`path`; None: the zygote's output pipe, where they went before). Returns what
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


def _enter(cwd: str | None) -> None:
    """Make `cwd` this process's directory, as the caller (who may not enter every directory
    that exists): ValueError saying why not, which becomes the job's reason."""
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise ValueError(f"cwd {cwd}: {exc.strerror}") from None


def _become_the_script(message: Script, command: Command, cwd: str | None) -> None:
    """The caller's environment, argv, import path, signals and fresh random seeds (a forked
    executor would otherwise repeat the zygote's streams)."""
    env = _caller_env(message)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    first = (os.path.dirname(os.path.abspath(command.path)) if command.path is not None
             else os.getcwd())
    extra = [p for p in message.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:1] = [first, *extra]
    sys.argv = [command.argv0, *command.args]
    signal.set_wakeup_fd(-1)  # the zygote's, closed in this process: a signal would write there
    random.seed()
    torch = imported("torch")  # imported by the zygote: a fresh seed (imported later: fresh)
    if torch is not None:
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _caller_env(message: Script) -> dict[str, str]:
    """The script's environment: who `Become` made the executor and the cuBLAS workspace the
    daemon books for it, then the caller's own, and the job's resume directory."""
    who = {k: os.environ[k] for k in ("HOME", "USER", "LOGNAME", "CUBLAS_WORKSPACE_CONFIG")
           if k in os.environ}
    resume = {} if message.resume_dir is None else {api.RESUME_ENV: message.resume_dir}
    return {**who, **message.env, **resume}


def _execute(command: Command) -> int:
    """Run the script as `__main__`: its exit status."""
    try:
        if command.module is not None:
            runpy.run_module(command.module, run_name="__main__", alter_sys=True)
        elif command.code is not None:
            _run_code(command.code)
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


def _run_code(code: str) -> None:
    """Run `python -c`'s program text as module `__main__`, as the interpreter does (file
    name `<string>`, no `__file__`)."""
    compiled = compile(code, "<string>", "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    exec(compiled, main.__dict__)


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
    flush()


def _forward_signals(client: socket.socket, boundary: Any) -> Callable[[], None]:
    """Raise in the script each signal the client forwards (`SIGNALS`), on a thread; returns
    what stops that thread (no byte the client sends to a rerun is read here after it). A
    signal is raised while holding `boundary` (the boundaries' lock), so that the script's
    handler never runs in the middle of a boundary's messages to the daemon (a Ctrl-C there is
    held by `Boundaries.on_sigint` too)."""
    stop_read, stop_write = os.pipe()

    def forward() -> None:
        while True:
            ready = select.select([client.fileno(), stop_read], [], [])[0]
            if stop_read in ready:
                return
            try:
                data = client.recv(64)
            except OSError:
                return
            if not data:
                return
            for byte in data:
                if byte == INTERRUPT[0]:  # `Boundaries.on_sigint` holds it during a boundary
                    os.kill(os.getpid(), signal.SIGINT)
                elif byte in SIGNALS:
                    with boundary:  # the script's own handler: outside boundaries
                        os.kill(os.getpid(), SIGNALS[byte])
                        time.sleep(SIGNAL_SETTLE_S)  # for the main thread to run it

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()

    def stop() -> None:
        os.write(stop_write, b"x")
        thread.join()
        os.close(stop_read)
        os.close(stop_write)

    return stop


def _tell_client(client: socket.socket | None, code: int) -> None:
    if client is None:
        return
    with contextlib.suppress(OSError):  # the client went away; the daemon knows the status
        client.sendall(json.dumps({"exit": code}).encode() + b"\n")
