"""`salusd run [OPTIONS] -- python train.py ARGS...`: run an unchanged script as a salusd job.

The script runs in a salusd executor as the caller (uid, groups, working directory,
environment, `sys.argv`), its iterations scheduled at its optimizer steps
(`salusd/executor/script.py`). This process hands the executor its own stdin and, for stdout
and stderr, stand-ins of the same kind: a pseudo-terminal where they are a terminal, else a
pipe (on a socket pair whose other end travels to the executor through the daemon), so the
script reads and writes as a direct run does; it relays what the script writes to its own
stdout and stderr and a copy to the job's output file, which `salusd logs JOB` reads
(`salusd/cli/relay.py`); it then waits for the script's exit status and exits with it. The
first Ctrl-C is raised in the script (SIGINT, as in a direct run); a second cancels the job.
SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 sent to this process are raised in the script, as Slurm's
`srun` forwards them: a script that saves a checkpoint on SIGTERM does so, and this process
exits with the script's status (143 where the script dies of it). With `--restart on-failure` a
failed run's command runs again, still attached to this terminal, and the status is the last
run's. Exit statuses of its own, from the job's `limit`, `exit_status` and `signal` fields
(never from its reason's text): 124 when it hit its `--time`, 125 when the job could not be
run, 128 + N when the script died of signal N (also the SIGTERM of a cancel), 1 when the job
ended otherwise (cancelled before its script ran, the daemon went away), with the reason on
stderr.

With `--here` (the default in a pod salusd's device plugin granted a share) the script runs in a
child of this process instead, taking turns from the daemon through a link the daemon adopts as
its executor's (`salusd/cli/here.py`): the pod's own process, interpreter and files.

`salusd run --devices N -- torchrun --nproc-per-node N train.py` (or `python -m
torch.distributed.run ...`) runs the ranks as one gang job (`salusd/engine/torchrun.py`): this
process hands each rank its own socket pair (the extra ones in `socket` requests before the
`run`), so every rank writes to this terminal, as under torchrun; Ctrl-C and the forwarded
signals reach every rank; the exit status is the job's `exit_status`: that of the rank whose
failure ended the job (as torchrun reports its first failure), else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

from salus.daemon.cli.control import Control
from salus.daemon.cli.here import GRANT_ENV, HereExecutor, in_pod
from salus.daemon.cli.relay import Relay
from salus.daemon.devices.discovery import parse_size
from salus.daemon.engine import torchrun
from salus.daemon.limits import (
    DEFAULT_PRIORITY,
    MAX_ARRAY_INDEX,
    MAX_ITERATIONS,
    MAX_JOB_ID,
    MAX_NAME_CHARS,
    MAX_RESTARTS,
    argument,
    check_iterations,
    check_name,
    check_priority,
)
from salus.daemon.state.store import ENDED_STATES
from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.address import default_socket_path, format_address
from salus.daemon.wire.errors import DaemonUnavailable, SalusError, ShuttingDown

CANNOT_RUN = 125  # as `env` and container runners say "the command did not run"
INTERRUPT = b"I"  # the executor raises SIGINT in the script for each (script.py)
# The other signals forwarded to the script, each as one byte on the same socket.
FORWARDED = {signal.SIGTERM: b"T", signal.SIGHUP: b"H", signal.SIGUSR1: b"1",
             signal.SIGUSR2: b"2"}
ENDED_WAIT_S = 10.0
TIME_LIMIT = 124  # the exit status of a job that hit its --time, as timeout(1) says it
SIGNAL_BEFORE_S = 60.0  # Slurm's --signal default
MAX_ARRAY_TASKS = 1000  # as Slurm's default MaxArraySize allows, about
ARRAY_OUTPUT = "salus-%A_%a.out"  # as sbatch's slurm-%A_%a.out


def duration(text: str) -> float:
    """Seconds of a Slurm-style duration: `90`, `90s`, `15m`, `2h`, `1d`, `M:S`, `H:M:S` or
    `D-H:M:S`."""
    try:
        if text[-1:] in "smhd" and text[:-1].replace(".", "", 1).isdigit():
            return float(text[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[text[-1]]
        days, _, clock = text.rpartition("-")
        parts = [float(p) for p in clock.split(":")]
        if not 1 <= len(parts) <= 3 or (days and len(parts) != 3):
            raise ValueError(text)
        seconds = sum(p * 60**i for i, p in enumerate(reversed(parts)))
        return seconds + (float(days) * 86400 if days else 0.0)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is no duration: use seconds, N[smhd] or [[D-]H:]M:S") from None


def early_signal(text: str) -> tuple[int, float]:
    """`SIG[@SECONDS]` (Slurm's `--signal`): the signal's number and how long before the
    time limit it is sent."""
    name, _, before = text.partition("@")
    try:
        signum = int(name) if name.isdigit() else int(
            signal.Signals["SIG" + name.upper().removeprefix("SIG")])
        return signum, float(before) if before else SIGNAL_BEFORE_S
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r}: use SIG[@SECONDS], e.g. USR1@60") from None


def memory_size(text: str) -> int:
    """Bytes of a size such as `512M`, `2G` or `1.5GiB` (`--mem`)."""
    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a job needs more than 0 bytes")
    return nbytes


def job_ids(text: str) -> list[int]:
    """The job ids of `--after`: `12` or `12,13`."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give job ids, e.g. 12 or 12,13") from None
    if not all(0 < job <= MAX_JOB_ID for job in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: a job id is a positive integer")
    return ids


def array_spec(text: str) -> tuple[list[int], int | None]:
    """The indexes of `--array` (`0-7`, `0,2,5`, `0-15:4`, sorted, each once) and the most
    tasks to run at once (`%N`; None: all)."""
    spec, _, most = text.partition("%")
    try:
        indexes: set[int] = set()
        for part in spec.split(","):
            span, _, step = part.partition(":")
            first, _, last = span.partition("-")
            low, high = int(first), int(last) if last else int(first)
            if not 0 <= low <= high <= MAX_ARRAY_INDEX or (step and int(step) < 1):
                raise ValueError(part)
            indexes.update(range(low, high + 1, int(step) if step else 1))
            if len(indexes) > MAX_ARRAY_TASKS:
                raise argparse.ArgumentTypeError(f"{text!r}: at most {MAX_ARRAY_TASKS} tasks")
        limit = int(most) if most else None
        if limit is not None and limit < 1:
            raise ValueError(most)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use indexes such as 0-7, 0,2,5 or 0-15:4, and %N for at most N at "
            "once") from None
    return sorted(indexes), limit


def add_parser(sub: Any) -> None:
    text = "run an unchanged training script as a salusd job (like srun python train.py)"
    cmd = sub.add_parser(
        "run", help=text, description=text[0].upper() + text[1:] + ". Its optimizer steps are "
        "the job's iteration boundaries; salus.step() adds more (SALUS_BOUNDARY=explicit: only "
        "those). Output goes to this terminal; the exit status is the script's.",
        usage="salusd run [OPTIONS] -- python SCRIPT [ARGS...] | python -m MODULE [ARGS...] | "
        "python -c CODE [ARGS...] | torchrun --nproc-per-node N SCRIPT [ARGS...]")
    cmd.add_argument("--name", type=argument(check_name),
                     help="the job's name (default: the script's file name)")
    cmd.add_argument("--iterations", type=argument(check_iterations, int), default=None,
                     help="planned iterations (optimizer steps), which SRTF uses (default: "
                     "unknown)")
    cmd.add_argument("--priority", type=argument(check_priority, float),
                     default=DEFAULT_PRIORITY,
                     help="the job's weight under the fair policy (default 1)")
    cmd.add_argument("--devices", type=int, default=None,
                     help="devices: 1, or a torchrun command's ranks, one per device (the "
                     "default)")
    cmd.add_argument("--restart", choices=["never", "on-failure"], default="never",
                     help="on-failure: when the script exits non-zero, its process dies or "
                     "salusd restarts, run it again (keep checkpoints in salus.resume_dir())")
    cmd.add_argument("--max-restarts", type=int, default=MAX_RESTARTS, metavar="N",
                     help=f"with --restart on-failure, at most N reruns (default "
                     f"{MAX_RESTARTS})")
    cmd.add_argument("--time", type=duration, default=None, metavar="DURATION",
                     help="a time limit, as Slurm's: SECONDS, N[smhd] or [[D-]H:]M:S; at the "
                     "limit the script gets SIGTERM, then SIGKILL after its --grace, "
                     f"and this exits {TIME_LIMIT}")
    cmd.add_argument("--signal", type=early_signal, default=None, metavar="SIG[@SECONDS]",
                     help="with --time: send SIG (TERM, INT, HUP, USR1, USR2 or a number) that "
                     "many seconds before the limit (default 60), as Slurm's --signal")
    cmd.add_argument("--grace", type=duration, default=None, metavar="DURATION",
                     help="seconds between SIGTERM and SIGKILL when the job is cancelled or hits "
                     "its --time (default: the daemon's --script-grace, 30 s)")
    cmd.add_argument("--mem", type=memory_size, default=None, metavar="SIZE",
                     help="the job's device memory, e.g. 512M or 2G, as Slurm's --mem: its "
                     "lane from the start (not sized from what it measures) and its cap (on a "
                     "GPU the allocator's; on the CPU the job ends once an iteration measures "
                     "more)")
    cmd.add_argument("--after", type=job_ids, action="append", default=None, metavar="JOB",
                     help="start once job JOB has finished (repeat it, or JOB,JOB,...: once "
                     "all have); when one fails or is cancelled this job fails, naming it "
                     "(Slurm's --dependency=afterok)")
    cmd.add_argument("--array", type=array_spec, default=None, metavar="INDEXES[%N]",
                     help="a job array, as Slurm's: one job per index (0-7, 0,2,5, 0-15:4), "
                     "each with SALUS_ARRAY_INDEX and SALUS_ARRAY_JOB_ID set and its output "
                     "in its own file (--output); %%N runs at most N at once; this waits for "
                     "all and exits with the highest status")
    cmd.add_argument("--output", default=ARRAY_OUTPUT, metavar="PATTERN",
                     help="with --array, each task's stdout and stderr: %%A the array's job id, "
                     "%%a the index, %%j the task's job id (default salus-%%A_%%a.out)")
    cmd.add_argument("--socket", metavar="PATH", default=None,
                     help="the daemon's socket (default: $SALUS_ADDRESS, else the default path)")
    cmd.add_argument("--here", action=argparse.BooleanOptionalAction, default=None,
                     help="run the script in this process's own child, taking turns from "
                     "salusd, instead of in an executor salusd starts (default: in a pod "
                     f"salusd granted a share, where ${GRANT_ENV} is set)")
    cmd.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND",
                     help="the interpreter and its arguments: python train.py ARGS...")


def run(args: argparse.Namespace) -> int:
    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        resolved = resolve(command)
        path = os.path.abspath(args.socket) if args.socket else default_socket_path()
        with Control(format_address(path), wait_forever=True) as link:
            return _run(link, resolved, args)
    except (SalusError, ValueError, OSError) as exc:
        print(f"salusd run: {exc}", file=sys.stderr)
        return CANNOT_RUN


def resolve(command: list[str]) -> list[str]:
    """`command` with its interpreter resolved as the caller's shell would (a bare name on
    PATH), its path made absolute; `torchrun` becomes `python -m torch.distributed.run` with
    the interpreter it runs. ValueError for a torchrun option salusd cannot honour."""
    if len(command) < 2:
        raise ValueError("nothing to run: salusd run [OPTIONS] -- python SCRIPT [ARGS...]")
    if os.sep in command[0]:  # a path: the executor checks what it is
        first = os.path.abspath(command[0])
    else:
        found = shutil.which(command[0])
        if found is None:
            raise ValueError(f"{command[0]!r}: command not found")
        first = os.path.abspath(found)
    resolved = [first, *command[1:]]
    if os.path.basename(first) == "torchrun":
        python = torchrun.interpreter_of(first)
        found = python if os.sep in python else shutil.which(python)
        if found is None:
            raise ValueError(f"{python!r} (the interpreter of {first}): command not found")
        resolved = [os.path.abspath(found), "-m", torchrun.MODULE, *command[1:]]
    torchrun.parse(resolved)
    return resolved


def _run(channel: Control, command: list[str], args: argparse.Namespace) -> int:
    launch = torchrun.parse(command)
    if args.array is not None and launch is not None:
        raise ValueError("--array runs one process per index; a torchrun gang cannot be a "
                         "task of an array")
    if args.here is None:
        args.here = in_pod()
    if args.here and args.array is not None:
        raise ValueError("--here runs one process, now: --array needs salusd's executors to "
                         "start its tasks (run it without --here, on the node)")
    if args.array is not None:
        from salus.daemon.cli.array import run_array

        return run_array(channel, command, args)
    here = HereExecutor() if args.here else None
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
             for _ in range(launch.nproc if launch is not None else 1)]
    with contextlib.ExitStack() as stack:
        relay = Relay(len(pairs))
        stack.callback(relay.close)
        if here is not None:
            stack.callback(here.reap)
            stack.callback(here.close)
            here.offer(channel)
        for rank, (ours, theirs) in enumerate(pairs):
            stack.enter_context(ours)
            stack.enter_context(theirs)
            socket.send_fds(ours, [b"stdio"], relay.stdio(rank))
        for _, theirs in pairs[1:]:  # ranks 1, 2...: the run's own is rank 0's
            channel.send(ops.Socket(), theirs.fileno())
            theirs.close()
            channel.reply()
        channel.send(run_request(command, args), pairs[0][1].fileno())
        pairs[0][1].close()
        reply = channel.reply()
        if here is not None:
            here.start(int(reply.get("threads") or 1))
        relay.copy_to(reply.get("output"))
        return _wait(channel, [ours for ours, _ in pairs], str(reply["job"]), relay, here)


def run_request(command: list[str], args: argparse.Namespace) -> ops.Run:
    """The `run` request of `command` with the options in `args`."""
    signum, before = args.signal if args.signal is not None else (None, None)
    return ops.Run(tuple(command), os.getcwd(), dict(os.environ),
                   name=args.name or _name(command, torchrun.parse(command)),
                   iterations=args.iterations or MAX_ITERATIONS, priority=args.priority,
                   devices=args.devices, restart=args.restart, max_restarts=args.max_restarts,
                   time_limit_s=args.time, signal=signum, signal_before_s=before,
                   grace_s=args.grace, mem_bytes=args.mem,
                   after=tuple(job for ids in args.after for job in ids) if args.after else None,
                   here=bool(args.here))


def _name(command: list[str], launch: torchrun.Launch | None) -> str:
    """The job's default name: the script's file name, the module's name, or `python -c`."""
    argv = list(launch.argv) if launch is not None else command[1:]
    while argv[:1] == ["-u"]:
        argv.pop(0)
    if argv[:1] == ["-c"]:
        return f"{os.path.basename(command[0])} -c"[:MAX_NAME_CHARS]
    for arg in argv:
        if not arg.startswith("-"):
            return os.path.basename(arg)[:MAX_NAME_CHARS] or "script"
    return "script"


def _wait(channel: Control, ranks: list[socket.socket], job: str, relay: Relay,
          here: HereExecutor | None = None) -> int:
    """Forward Ctrl-C and `FORWARDED` signals to every rank, and relay their output, until
    each rank's exit status comes (or its socket closes); the status to exit with. `here`:
    the script ran in our own child, whose death by a signal is its status when it sent
    none."""
    interrupts = 0

    def send(data: bytes) -> None:
        for ours in ranks:
            with contextlib.suppress(OSError):
                ours.send(data)

    def forward(signum: int, frame: FrameType | None) -> None:
        send(FORWARDED[signal.Signals(signum)])

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            send(INTERRUPT)
        elif interrupts == 2:
            print(f"\nsalusd run: cancelling job {job}", file=sys.stderr)
            with contextlib.suppress(OSError):
                channel.send(ops.Cancel(job))

    # A signal that comes just before the wait below blocks would run its handler only once
    # something else woke it (a Ctrl-C or a resize left waiting for the script's next
    # output): the wake-up descriptor wakes it.
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    previous_wake = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, on_sigint),
                signal.SIGWINCH: signal.signal(signal.SIGWINCH, lambda *_: relay.resize())}
    for signum in FORWARDED:
        previous[signum] = signal.signal(signum, forward)
    try:
        statuses = _statuses(ranks, relay, wake_r)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(previous_wake)
        wake_r.close()
        wake_w.close()
    code = here.reap() if here is not None else None
    # A gang's status is the job's: its first failed rank's (`exit_status`), else 0.
    if len(ranks) > 1:
        return final_status(channel, job, 0 if all(s == 0 for s in statuses) else None)
    return final_status(channel, job, statuses[0],
                        128 - code if code is not None and code < 0 else None)


def final_status(channel: Control, job: str, status: int | None,
                 died: int | None = None) -> int:
    """What to exit with for `job`, whose script sent exit status `status` (None: none came):
    from the job's `limit`, `exit_status` and `signal` fields once the daemon ended it.
    `died`: the status of our own child's death by a signal (`--here`), for when the daemon
    has none."""
    try:
        info = _ended_info(channel, job)  # so that what follows sees the job ended
    except (SalusError, OSError) as exc:
        if status is not None:
            if isinstance(exc, ShuttingDown | DaemonUnavailable | OSError):
                print(f"salusd run: salusd stopped while job {job} ran (it keeps the job for "
                      f"its restart); its command exited with status {status}", file=sys.stderr)
            return status
        print(f"salusd run: job {job}'s script was lost: {exc}", file=sys.stderr)
        return died or 1
    if info.get("limit") == "time":
        print(f"salusd run: job {job} {info.get('reason')}", file=sys.stderr)
        return TIME_LIMIT
    if status is not None:
        return status
    # The executor went away without the script's status: say why.
    reason = str(info.get("reason") or info.get("state"))
    print(f"salusd run: job {job} {info.get('state', 'ended')}: {reason}", file=sys.stderr)
    code = info.get("exit_status")
    return code if type(code) is int else died or 1


def _statuses(ranks: list[socket.socket], relay: Relay,
              wake: socket.socket) -> list[int | None]:
    """Each rank's exit status, once its (last) run sends it; None for a rank whose socket
    closed without one. Meanwhile the ranks' output is relayed, and what they wrote before
    their statuses came is taken in after. A rerun (`--restart on-failure`) asks for the
    descriptors again first. `wake` is readable when a signal came (its handler has run once
    the wait returns)."""
    statuses: list[int | None] = [None] * len(ranks)
    data = [b""] * len(ranks)
    open_ = set(range(len(ranks)))
    while open_:
        watched: list[socket.socket | int] = [*(ranks[r] for r in open_), *relay.fds(), wake]
        ready = select.select(watched, [], [])[0]
        if wake in ready:
            with contextlib.suppress(BlockingIOError):
                wake.recv(4096)
        for fd in [fd for fd in ready if isinstance(fd, int)]:
            relay.pump(fd)
        for rank in [r for r in open_ if ranks[r] in ready]:
            try:
                chunk = ranks[rank].recv(4096)
            except ConnectionResetError:  # closed with our descriptors unread: never started
                chunk = b""
            if not chunk:
                open_.discard(rank)
                continue
            data[rank] += chunk
            while b"\n" in data[rank]:
                line, data[rank] = data[rank].split(b"\n", 1)
                message = json.loads(line)
                if "exit" in message:
                    statuses[rank] = int(message["exit"])
                    open_.discard(rank)
                    break
                if message.get("stdio"):
                    socket.send_fds(ranks[rank], [b"stdio"], relay.stdio(rank))
    relay.drain()
    return statuses


def _ended_info(channel: Control, job: str) -> dict[str, Any]:
    """The job's info once the daemon has ended it and its command is over (it learns of an
    exit or a death within moments), or as it stands after ENDED_WAIT_S seconds."""
    for _ in range(int(ENDED_WAIT_S / 0.02)):
        info = channel.call(ops.Info(job))
        if info.get("state") in ENDED_STATES and not info.get("grace"):
            break
        time.sleep(0.02)
    return info
