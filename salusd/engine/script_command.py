"""What a script job runs (`ScriptCommand`), checked once for every front end: the unix
socket's `salusd run` and REST's `POST /v1/jobs {"command"}` build it with `check`, then add
their limits, grace, memory request and array task with the `with_*` functions, each of which
raises BadRequest naming what is wrong. How the engine runs it is `scripts.py`'s."""

from __future__ import annotations

import dataclasses
import os
import signal
from dataclasses import dataclass, field

from salus.daemon.engine import torchrun
from salus.daemon.limits import (
    MAX_ARGS,
    MAX_ARRAY_INDEX,
    MAX_ENV_BYTES,
    MAX_GRACE_S,
    MAX_MEM_BYTES,
    MAX_PATH_CHARS,
    MAX_RESTARTS,
    MAX_RESTARTS_LIMIT,
    MAX_TIME_LIMIT_S,
)
from salus.daemon.wire.control_ops import Run
from salus.daemon.wire.errors import BadRequest

RESTART_POLICIES = ("never", "on-failure")
LIMIT_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                           signal.SIGUSR2})


@dataclass(frozen=True)
class ScriptCommand:
    """What the caller runs: `command` (its interpreter first, as resolved in the caller's
    shell), in directory `cwd`, with environment `env`, and its restart policy; its time limit
    (`time_limit_s`, seconds from its start; None: none) and the signal its command gets
    `signal_before_s` before it (`signal`, a number; None: none), as Slurm's `--time` and
    `--signal`; its grace (`grace_s`, seconds between SIGTERM and SIGKILL when it is cancelled
    or hits its limit; None: the daemon's `--script-grace`), as Kubernetes'
    `terminationGracePeriodSeconds`; its device-memory request (`mem_bytes`, Slurm's `--mem`;
    None: sized from what it measures); for a task of a job array (`salusd run --array`), its
    index and the array's job id, the first task's (None for the first task itself). `launch`
    is what a torchrun command asks for (None: any other command)."""

    command: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    restart: str = "never"
    max_restarts: int = MAX_RESTARTS
    time_limit_s: float | None = None
    signal: int | None = None
    signal_before_s: float = 0.0
    grace_s: float | None = None
    mem_bytes: int | None = None
    array_index: int | None = None
    array_job: int | None = None  # the array's first job (None: this one is)
    launch: torchrun.Launch | None = field(init=False, default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "launch", torchrun.parse(self.command))

    @property
    def ranks(self) -> int:
        """Processes the command runs: torchrun's ranks, else 1."""
        return self.launch.nproc if self.launch is not None else 1


def check(command: object, cwd: object, env: object, restart: object,
          max_restarts: object = MAX_RESTARTS) -> ScriptCommand:
    """A `ScriptCommand` from a request's fields; BadRequest names what is wrong."""
    if (not isinstance(command, list | tuple) or not 2 <= len(command) <= MAX_ARGS
            or not all(isinstance(a, str) and "\0" not in a and _encodable(a)
                       for a in command)):
        raise BadRequest(f"'command' must be a list of 2 to {MAX_ARGS} strings (without NUL, "
                         "encodable as UTF-8): the interpreter and its arguments, e.g. "
                         "[\"python\", \"train.py\"]")
    if (not isinstance(cwd, str) or not os.path.isabs(cwd) or len(cwd) > MAX_PATH_CHARS
            or "\0" in cwd or not _encodable(cwd)):
        raise BadRequest(f"'cwd' must be an absolute path of at most {MAX_PATH_CHARS} "
                         "characters, without NUL, encodable as UTF-8")
    if env is None:
        env = {}
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadRequest("'env' must be an object of strings")
    bad = next((k for k, v in env.items()
                if not k or "=" in k or "\0" in k + v or not _encodable(k + v)), None)
    if bad is not None:
        raise BadRequest(f"'env' has the variable {bad!r}: a name must be non-empty, without "
                         "'=' or NUL, and a value without NUL, both encodable as UTF-8")
    if sum(len(k) + len(v) for k, v in env.items()) > MAX_ENV_BYTES:
        raise BadRequest(f"'env' holds more than {MAX_ENV_BYTES} characters")
    if restart not in RESTART_POLICIES:
        raise BadRequest(f"'restart' must be one of {list(RESTART_POLICIES)}, not {restart!r}")
    if type(max_restarts) is not int or not 0 <= max_restarts <= MAX_RESTARTS_LIMIT:
        raise BadRequest(f"'max_restarts' must be an integer from 0 to {MAX_RESTARTS_LIMIT}, "
                         f"not {max_restarts!r}")
    try:
        checked = ScriptCommand(tuple(command), cwd, dict(env), str(restart), max_restarts)
    except ValueError as exc:  # a torchrun option salusd cannot honour
        raise BadRequest(str(exc)) from None
    if checked.ranks > 1 and restart != "never":
        raise BadRequest("--restart on-failure reruns one process; a torchrun gang of "
                         f"{checked.ranks} ranks is not rerun")
    return checked


def from_run(run: Run) -> ScriptCommand:
    """The command of a `run` request (the socket's, or REST's body made one), with its
    limits, grace, memory and array place; BadRequest names what is wrong."""
    command = check(run.command, run.cwd, run.env, run.restart, run.max_restarts)
    command = with_limits(command, run.time_limit_s, run.signal, run.signal_before_s)
    command = with_grace(command, run.grace_s)
    command = with_memory(command, run.mem_bytes)
    return with_array(command, run.array_index, run.array_job)


def gang_devices(command: ScriptCommand, devices: object) -> object:
    """The devices a script job asks for: a torchrun gang's ranks where the request left
    them out (None), else `devices`, which must then be its ranks; BadRequest says so."""
    if devices is None:
        return command.ranks
    if command.launch is not None and devices != command.ranks:
        raise BadRequest(f"torchrun runs {command.ranks} rank(s) (--nproc-per-node) and the "
                         f"job asks for {devices!r} device(s): salusd runs one rank per "
                         "device, so give both the same number")
    if command.launch is None and devices != 1:
        raise BadRequest("a script job runs on one device; for several, run it with torchrun "
                         "(salusd run --devices N -- torchrun --nproc-per-node N train.py) or "
                         "use salus.connect(devices=N)")
    return devices


def _encodable(text: str) -> bool:
    """Whether UTF-8 can encode `text` (a lone surrogate cannot reach an environment)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def with_limits(command: ScriptCommand, time_limit_s: object, signum: object,
                before_s: object) -> ScriptCommand:
    """`command` with a request's `time_limit_s`, `signal` and `signal_before_s` (each may be
    left out); BadRequest names what is wrong."""
    if time_limit_s is None and signum is None:
        return command
    limit = _seconds(time_limit_s, "time_limit_s", MAX_TIME_LIMIT_S)
    if signum is not None and (type(signum) is not int or signum not in LIMIT_SIGNALS):
        raise BadRequest(f"'signal' must be one of the signal numbers {sorted(LIMIT_SIGNALS)}")
    before = 0.0 if before_s is None else _seconds(before_s, "signal_before_s", limit)
    return dataclasses.replace(command, time_limit_s=limit,
                               signal=signum if type(signum) is int else None,
                               signal_before_s=before)


def with_grace(command: ScriptCommand, grace_s: object) -> ScriptCommand:
    """`command` with a request's `grace_s` (None: the daemon's); BadRequest when it is not
    seconds from 0 to `MAX_GRACE_S`."""
    if grace_s is None:
        return command
    return dataclasses.replace(command, grace_s=_seconds(grace_s, "grace_s", MAX_GRACE_S))
def with_memory(command: ScriptCommand, mem_bytes: object) -> ScriptCommand:
    """`command` with a request's `mem_bytes` (may be left out); BadRequest names what is
    wrong. Whether a device can hold it is the engine's check."""
    if mem_bytes is None:
        return command
    if type(mem_bytes) is not int or not 0 < mem_bytes <= MAX_MEM_BYTES:
        raise BadRequest(f"'mem_bytes' must be an integer from 1 to {MAX_MEM_BYTES} (bytes)")
    return dataclasses.replace(command, mem_bytes=mem_bytes)


def check_here(command: ScriptCommand, link: object, after: object) -> None:
    """A `run --here`: the caller runs the command in its own process (`link`: the daemon's end
    of that process's link, from the `socket` request before), which salusd can neither start
    again nor start later; BadRequest says what it cannot do."""
    if link is None:
        raise BadRequest("'run' with 'here' needs its executor's link: a 'socket' request "
                         "with 'executor' before it")
    if command.launch is not None:
        raise BadRequest("--here runs one process: a torchrun gang runs in salusd's executors, "
                         "one per rank (run it without --here, on the node)")
    if command.restart != "never":
        raise BadRequest("--here runs the command in salusd run's own process, which salusd "
                         "cannot start again: --restart on-failure needs salusd's executors "
                         "(rerun salusd run instead, as a Kubernetes Job's restartPolicy does)")
    if after:
        raise BadRequest("--here starts the command now, in salusd run's own process: --after "
                         "needs salusd's executors to start it later")


def with_array(command: ScriptCommand, index: object, job: object) -> ScriptCommand:
    """`command` as task `index` of the job array whose first job is `job` (both may be left
    out; `job` also for the first task itself); BadRequest names what is wrong."""
    if index is None and job is None:
        return command
    if type(index) is not int or not 0 <= index <= MAX_ARRAY_INDEX:
        raise BadRequest(f"'array_index' must be an integer from 0 to {MAX_ARRAY_INDEX}")
    if job is not None and (type(job) is not int or not 0 < job < 2**63):
        raise BadRequest("'array_job' must be a job id")
    return dataclasses.replace(command, array_index=index,
                               array_job=job if type(job) is int else None)


def _seconds(value: object, name: str, most: float) -> float:
    if type(value) not in (int, float) or not 0 <= float(value) <= most:  # type: ignore[arg-type]
        raise BadRequest(f"'{name}' must be seconds from 0 to {most:g}")
    return float(value)  # type: ignore[arg-type]
