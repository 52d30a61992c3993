"""The requests of the daemon's unix socket (`salusd/frontend/handlers.py` lists what each does):
one frozen type per op, in the typed codec (`salusd/wire/typed.py`).

A client (the torch adapter, `salusd` CLI, `salusd run`) sends `encode(request)`; the front end
decodes every request with `decode_control`, which checks each field's type and refuses unknown
fields, so what a handler reads is typed. The checks of a field's value (a job id that exists
and is the caller's, a name's length, a command's arguments) stay with the code that uses it,
which REST shares (`script_command.from_run`). Unlike the executor protocol, a field may be
sent holding its default (clients of several versions and languages build these).

The fields a request forwards to the job's executor untouched (`objects`, `fn`, `args`, `rng`,
`names`: pickled payloads and tensor references, checked by `wire/refs.check_json`) are `Any`
here: the executor decodes them. Standard library only, as the CLI imports it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from salus.daemon.limits import MAX_RESTARTS
from salus.daemon.wire.typed import Wire, from_wire, to_wire

JobId = int | str  # clients send a job's id as the string `open` returned, or as an int


@dataclass(frozen=True, slots=True)
class Ping:
    op: ClassVar[str] = "ping"
    max_frame_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Open:
    op: ClassVar[str] = "open"
    name: str | None = None
    iterations: int | None = None
    cwd: str | None = None
    devices: int = 1
    python: str | None = None  # the client's interpreter, an absolute path


@dataclass(frozen=True, slots=True)
class Attach:
    op: ClassVar[str] = "attach"
    job: JobId
    objects: Any
    rng: Any = None


@dataclass(frozen=True, slots=True)
class Define:
    op: ClassVar[str] = "define"
    job: JobId
    fid: int
    kind: str  # "iteration" or "function"
    fn: Any
    inference: bool = False


@dataclass(frozen=True, slots=True)
class Call:
    op: ClassVar[str] = "call"
    job: JobId
    args: Any
    fid: int | None = None  # a defined function, or `fn` itself
    fn: Any = None
    rng: Any = None


@dataclass(frozen=True, slots=True)
class Pull:
    op: ClassVar[str] = "pull"
    job: JobId
    names: Any = None


@dataclass(frozen=True, slots=True)
class Channel:
    op: ClassVar[str] = "channel"
    job: JobId


@dataclass(frozen=True, slots=True)
class Info:
    op: ClassVar[str] = "info"
    job: JobId


@dataclass(frozen=True, slots=True)
class Close:
    op: ClassVar[str] = "close"
    job: JobId


@dataclass(frozen=True, slots=True)
class Status:
    op: ClassVar[str] = "status"


@dataclass(frozen=True, slots=True)
class Suspend:
    op: ClassVar[str] = "suspend"
    job: JobId
    swap: bool = False


@dataclass(frozen=True, slots=True)
class Resume:
    op: ClassVar[str] = "resume"
    job: JobId


@dataclass(frozen=True, slots=True)
class Cancel:
    op: ClassVar[str] = "cancel"
    job: JobId


@dataclass(frozen=True, slots=True)
class Priority:
    op: ClassVar[str] = "priority"
    job: JobId
    priority: float


@dataclass(frozen=True, slots=True)
class Logs:
    op: ClassVar[str] = "logs"
    job: JobId
    offset: int | None = None  # a byte offset in the output file; None: its last 64 KiB


@dataclass(frozen=True, slots=True)
class Socket:
    """One more client socket (in the frame's descriptor), for a rank of the next `Run`; with
    `executor`, the daemon's end of the link of the executor `salusd run --here` runs itself,
    for the next `Run` with `here`."""

    op: ClassVar[str] = "socket"
    executor: bool = False


@dataclass(frozen=True, slots=True)
class Run:
    """A script job (`salusd run`, or REST's `command`): `command` run in `cwd` with `env`, as
    the caller; the limits and options as `salusd run`'s flags say them (None: not given)."""

    op: ClassVar[str] = "run"
    command: tuple[str, ...]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    iterations: int | None = None
    priority: float = 1.0
    devices: int | None = None  # None: a torchrun gang's ranks, else 1
    restart: str = "never"
    max_restarts: int = MAX_RESTARTS
    time_limit_s: float | None = None
    signal: int | None = None
    signal_before_s: float | None = None
    grace_s: float | None = None
    mem_bytes: int | None = None
    after: tuple[JobId, ...] | None = None
    array_index: int | None = None
    array_job: int | None = None
    here: bool = False  # the caller runs the script itself (`salusd run --here`)


Request = (Ping | Open | Attach | Define | Call | Pull | Channel | Info | Close | Status
           | Suspend | Resume | Cancel | Priority | Logs | Socket | Run)
REQUESTS: tuple[type[Request], ...] = typing.get_args(Request)
OPS: dict[str, type[Request]] = {cls.op: cls for cls in REQUESTS}
Forwarded = Attach | Define | Call | Pull | Channel  # answered by the job's executor
FORWARDED: tuple[type[Forwarded], ...] = typing.get_args(Forwarded)


def encode(request: Request) -> Wire:
    """The JSON object a client sends for `request`."""
    return to_wire(request)


def decode_control(d: Wire) -> Request:
    """The request `d` (a JSON object with a known string `op`) is; ValueError names the
    field that is wrong."""
    return typing.cast(Request, from_wire(OPS[d["op"]], d, f"request {d['op']!r}",
                                          canonical=False))
