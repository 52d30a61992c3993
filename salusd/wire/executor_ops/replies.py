"""Executor → daemon: the replies (and what the executor says unasked) of the executor
protocol, one frozen type each (see the package's docstring for the protocol)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, ClassVar


# ---- executor → daemon ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ack:
    """Done (`lease`, `refuse`, `define`, `pull`, `channel`, `place`, `swap_out`). `forward`:
    the client's answer follows (in every reply type alike)."""

    op: ClassVar[str] = "ack"
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed: `message` says why (None: the forwarded answer says it)."""

    op: ClassVar[str] = "failed"
    message: str | None
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Estimated:
    """The call's peak ephemeral `bytes`, found by `method` ("fake-tensor"), and the CUDA
    caching allocator's `reserved_bytes` for them (None, left out of the wire: not sent)."""

    op: ClassVar[str] = "estimated"
    bytes: int
    method: str
    forward: bool = False
    reserved_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class EstimateFailed:
    """The call cannot run on fake tensors (`reason`): its first real run is measured."""

    op: ClassVar[str] = "estimate_failed"
    reason: str
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Attached:
    """The attached objects hold `persistent_bytes` (`persistent_reserved_bytes` in the CUDA
    caching allocator's units; None, left out of the wire: not sent); the executor runs
    `threads` intra-op threads."""

    op: ClassVar[str] = "attached"
    persistent_bytes: int
    threads: int
    forward: bool = False
    persistent_reserved_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Loaded:
    """A batch job's entrypoint or a checkpoint was loaded: the state's `persistent_bytes`
    (`persistent_reserved_bytes` as in `Attached`) and the iteration it stands at (0: from the
    start)."""

    op: ClassVar[str] = "loaded"
    persistent_bytes: int
    iteration: int
    forward: bool = False
    persistent_reserved_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """A checkpoint of `iteration` was written to `path`: `bytes` on disk in `seconds`, at
    wall-clock `time` (seconds since the epoch)."""

    op: ClassVar[str] = "checkpointed"
    iteration: int
    bytes: int
    seconds: float
    path: str
    time: float
    forward: bool = False


@dataclass(frozen=True, slots=True)
class CallDone:
    """A `Run` returned: whether it was `ok`, its `seconds`, its measured `peak` ephemeral bytes
    (None: not measured), whether it was an iteration (`counted`), when the function `began`
    and `ended`; `message` when it failed; the job's data cache and `s.comm` counters where it
    uses them. `empty`: the call had already run under a lease, and nothing ran now (`began`
    and `ended` are None). `oom`: the call failed out of device memory; `peak` is then what it
    reached, at least its cap (it needs more), left out of the wire when False."""

    op: ClassVar[str] = "call_done"
    ok: bool
    seconds: float
    peak: int | None
    counted: bool
    began: float | None
    ended: float | None
    message: str | None = None
    cache: dict[str, Any] | None = None
    comm: dict[str, Any] | None = None
    empty: bool = False
    forward: bool = False
    oom: bool = False


@dataclass(frozen=True, slots=True)
class StepDone:
    """A batch job's `Step` returned: as `CallDone`, with the job's `iteration` count after it,
    its `loss` (None when not one number; only when `ok`), its `evaluation` (every N
    iterations, a number or text) and, when its code raised, the `message` and `traceback`;
    `oom` as in `CallDone`."""

    op: ClassVar[str] = "step_done"
    ok: bool
    seconds: float
    peak: int | None
    counted: bool
    began: float
    ended: float
    iteration: int
    loss: float | None = None
    evaluation: float | str | None = None
    message: str | None = None
    traceback: str | None = None
    cache: dict[str, Any] | None = None
    comm: dict[str, Any] | None = None
    forward: bool = False
    oom: bool = False


@dataclass(frozen=True, slots=True)
class Ready:
    """Unsolicited: a direct call waits for a `Run`; whether it is an iteration (`counted`)
    and, for a job's first call where the executor estimates, its estimate."""

    op: ClassVar[str] = "ready"
    counted: bool
    estimate: Estimated | EstimateFailed | None = None


@dataclass(frozen=True, slots=True)
class Ran:
    """Unsolicited: `calls` ran under the lease (`iterations` of them iterations, `failed`
    failed), the iterations taking `seconds` in all, the largest `peak` (bytes; None: none
    measured); the first `began` and the last `ended`; `oom`: one of them failed out of device
    memory (`peak` is then at least its cap; left out of the wire when False)."""

    op: ClassVar[str] = "ran"
    calls: int
    iterations: int
    failed: int
    seconds: float
    peak: int | None
    began: float
    ended: float
    oom: bool = False


@dataclass(frozen=True, slots=True)
class HandedOver:
    """The job was given up (`ok`; its bundle frame follows, then its channel's socket when
    `channel`, then its channel's pool when `pool`) or stays here (`message` says why: its
    state cannot be pickled again). `pool` False is left out of the wire."""

    op: ClassVar[str] = "handed_over"
    ok: bool
    channel: bool
    message: str | None = None
    forward: bool = False
    pool: bool = False


@dataclass(frozen=True, slots=True)
class Exited:
    """Unsolicited: a script job's command ended with exit status `code` (a signal N that
    the script died of in its own process is 128 + N, as a shell reports it)."""

    op: ClassVar[str] = "exited"
    code: int


@dataclass(frozen=True, slots=True)
class Placed:
    """Done (`place` on a GPU): moving the job's state in made the process reserve
    `reserved_bytes` more (measured: `torch.cuda.memory_reserved`), which the daemon books
    where it is more than its model of the allocator gave."""

    op: ClassVar[str] = "placed"
    reserved_bytes: int
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Poisoned:
    """Unsolicited: a call of the job hit a sticky CUDA error (`message`), which leaves the
    process's CUDA context unusable; the executor ends right after it (its jobs fail)."""

    op: ClassVar[str] = "poisoned"
    message: str


@dataclass(frozen=True, slots=True)
class Progress:
    """Unsolicited: what a script's framework callback knows (`salus.lightning`,
    `salus.hf`): its own `step` count, its planned `max_steps` (None: unknown) and the last
    logged `loss` (None: none)."""

    op: ClassVar[str] = "progress"
    step: int
    max_steps: int | None
    loss: float | None


@dataclass(frozen=True, slots=True)
class Swapped:
    """Done (a script job's `swap_out`, or its `place` after one): what the move reached and
    what it left (`salusd/executor/script_swap.py`: counts, bytes, a note)."""

    op: ClassVar[str] = "swapped"
    swap: dict[str, int | str | None]
    forward: bool = False


Reply = (Ack | Failed | HandedOver | Estimated | EstimateFailed | Attached | Loaded | Checkpointed
         | CallDone | StepDone | Ready | Ran | Exited | Placed | Poisoned | Progress | Swapped)


def succeeded(reply: Reply) -> bool:
    """Whether `reply` says its request was done (`Failed`, or `ok` false, says not)."""
    return not isinstance(reply, Failed) and getattr(reply, "ok", True)


def failure(reply: Reply) -> str:
    """What a reply that did not succeed says of why."""
    return str(getattr(reply, "message", None) or "no reason given")


REPLIES: tuple[type[Reply], ...] = typing.get_args(Reply)
#: what the executor sends unasked, between its replies (it answers no request)
UNSOLICITED: tuple[type[Reply], ...] = (Ready, Ran, Exited, Poisoned, Progress)


__all__ = [
    "Ack",
    "Attached",
    "CallDone",
    "Checkpointed",
    "Estimated",
    "EstimateFailed",
    "Exited",
    "Failed",
    "failure",
    "HandedOver",
    "Loaded",
    "Placed",
    "Poisoned",
    "Progress",
    "Ran",
    "Ready",
    "REPLIES",
    "Reply",
    "StepDone",
    "succeeded",
    "Swapped",
    "UNSOLICITED",
]
