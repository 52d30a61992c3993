"""The message types of the daemon<->executor protocol (see the package's docstring)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, ClassVar

Wire = dict[str, Any]


# ---- nested values --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GangPlace:
    """Where a replica stands in its gang (`salusd/executor/gang.py`): its `rank` of `world`.

    One node: replica 0 hosts the rendezvous on loopback `port`. Across nodes: the cluster's
    store at `store` (HOST:PORT) under the prefix `key`, `local` replicas per node, and
    `loopback` when every node is on this machine. A field left None is left out of the wire.
    """

    rank: int
    world: int
    port: int | None = None
    local: int | None = None
    store: str | None = None
    key: str | None = None
    loopback: bool | None = None


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    """A pipeline job's split (`salusd/engine/pipeline_spec.py`): the placement allocator
    ("even", "sky", "optimal") and the micro-batches per iteration."""

    placement: str
    microbatches: int


@dataclass(frozen=True, slots=True)
class CachePlace:
    """The owner's data cache directory (level 1 of `salus.data.CachedDataset`) and its cap
    per replica (bytes)."""

    dir: str
    bytes: int


# ---- daemon → executor ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Become:
    """Who the executor process runs as (uid, gid, groups, user name, home) and its intra-op
    `threads`: sent once, first, to a new process. The jobs it then hosts are all this owner's
    (`Host`)."""

    op: ClassVar[str] = "become"
    uid: int
    gid: int
    groups: tuple[int, ...]
    user: str
    home: str
    threads: int


@dataclass(frozen=True, slots=True)
class Host:
    """Host the job this message is addressed to: its calls run in directory `cwd`; whether
    the executor estimates its first direct call before asking to run it (`estimate`); the
    file what it prints goes to (`log`; None: none, left out of the wire form)."""

    op: ClassVar[str] = "host"
    cwd: str | None
    estimate: bool
    log: str | None = None


@dataclass(frozen=True, slots=True)
class Handover:
    """Give the job up to another executor process of its owner: answered by `HandedOver`,
    followed (when it is ok) by the job's bundle frame and, when the job has a direct
    channel, the channel's socket."""

    op: ClassVar[str] = "handover"


@dataclass(frozen=True, slots=True)
class Adopt:
    """Take the job over from another executor: the bundle frame follows, then the socket of
    its direct channel when `channel`, then (`pool`) the shared memory its client sends large
    tensors through on that channel. `pool` False is left out of the wire."""

    op: ClassVar[str] = "adopt"
    channel: bool
    pool: bool = False


@dataclass(frozen=True, slots=True)
class Attach:
    """Load the client's named objects (in the frame that follows); a gang's replica joins its
    gang's process group first (`gang`: its place; None for a job of one executor)."""

    op: ClassVar[str] = "attach"
    gang: GangPlace | None


@dataclass(frozen=True, slots=True)
class Define:
    """Hold the function in the frame that follows (its id, kind and pickled body)."""

    op: ClassVar[str] = "define"


@dataclass(frozen=True, slots=True)
class Pull:
    """Send the named objects of the frame that follows back to the client."""

    op: ClassVar[str] = "pull"


@dataclass(frozen=True, slots=True)
class DirectChannel:
    """Serve the job's direct channel: the client's socket travels with the frame that
    follows."""

    op: ClassVar[str] = "channel"


@dataclass(frozen=True, slots=True)
class Estimate:
    """The peak ephemeral bytes of a call run on fake tensors: the client's call in the frame
    that follows, or (`frame` False) a batch job's next batch. `frame` None leaves the key out,
    which means a frame follows."""

    op: ClassVar[str] = "estimate"
    frame: bool | None = None


@dataclass(frozen=True, slots=True)
class Run:
    """Run one call: the client's, in the frame that follows (`frame` true or None, which
    leaves the key out, as a gang's calls are sent), or (`frame` False) the oldest direct call
    waiting in the executor. `counted` is the daemon's reading of whether it is an iteration;
    the executor decides (`CallDone.counted`)."""

    op: ClassVar[str] = "run"
    counted: bool
    frame: bool | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """Run a batch job's next iteration on its next batch."""

    op: ClassVar[str] = "step"


@dataclass(frozen=True, slots=True)
class Lease:
    """Run direct calls at once (`granted`), or give the lane back once the running call
    returned (not granted)."""

    op: ClassVar[str] = "lease"
    granted: bool


@dataclass(frozen=True, slots=True)
class Place:
    """Run on torch `device` within `budget_bytes` (persistent bytes plus the lane, and on CUDA
    the process's cuBLAS(Lt) workspaces; enforced on CUDA), slowed by the device's simulated
    `slowdown` factor (1.0: none). On a GPU, `uuid` names it as NVML and
    `CUDA_VISIBLE_DEVICES` do ("GPU-…", filled in by the supervisor).
    `lane` is the lane's id and `lane_bytes` its size: an executor hosting several jobs of
    one lane caps its process at their persistent bytes plus one lane. `shared`: other
    processes run in the same lane, so this one returns its cached device memory after each
    call. `mps`: the pipe directory of the GPU's MPS server, which a process whose CUDA has
    not started joins as a client held to `mps_limit_bytes` (`salusd/devices/mps.py`).
    `workspace_bytes`: the cuBLAS workspaces the process reserves on a GPU, once however many
    jobs it hosts, outside `budget_bytes` (the cap adds them: `executor/cap.py`). With `mps`,
    `mps_limit_bytes` is what the process's CUDA context costs (its pinned limit is its cap
    plus that) and `mps_threads` its `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`. `total_bytes`: the
    GPU's memory (filled in by the supervisor), of which a script's JAX or TensorFlow may take
    the budget's fraction (`executor/framework_memory.py`). A None or False field is left out
    of the wire."""

    op: ClassVar[str] = "place"
    device: str
    budget_bytes: int
    slowdown: float
    uuid: str | None = None
    lane: int | None = None
    lane_bytes: int | None = None
    shared: bool = False
    mps: str | None = None
    mps_limit_bytes: int | None = None
    workspace_bytes: int | None = None
    mps_threads: int | None = None
    total_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Load:
    """Import a batch job's entrypoint `path`:`function` and hold what it returns; with
    `restore`, go on from the latest checkpoint under `dir`. `pipeline`: run it split into
    stages; `cache`: the owner's data cache; `gang`: this replica's place (None, left out of
    the wire: no gang); `at`: restore the checkpoint of this iteration, not the latest (a
    gang's replicas go on from the newest one they all hold; None, left out: the latest)."""

    op: ClassVar[str] = "load"
    path: str
    function: str
    restore: bool
    pipeline: PipelineOptions | None
    cache: CachePlace | None
    dir: str | None
    gang: GangPlace | None = None
    at: int | None = None


@dataclass(frozen=True, slots=True)
class Restore:
    """Load an interactive job's latest checkpoint under `dir` (after a restart); `gang` and
    `at` as in `Load`."""

    op: ClassVar[str] = "restore"
    dir: str | None
    gang: GangPlace | None = None
    at: int | None = None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Write the job's state (job id `job`) under `dir` at this boundary."""

    op: ClassVar[str] = "checkpoint"
    dir: str | None
    job: int


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Move the job's state to host memory (its device budget is released)."""

    op: ClassVar[str] = "swap_out"


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer every direct call waiting in the executor with the error `code` and `message`."""

    op: ClassVar[str] = "refuse"
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Script:
    """Run a script job's command (`salusd/executor/script.py`): `interpreter` is the command's
    first word (the caller's `python`; the executor runs the script in that interpreter), `argv`
    what follows it (`train.py ARGS`, `-m module ARGS`), `env` the caller's
    environment, `resume_dir` the job's directory that survives restarts (None: none). With
    `frame` true or None (left out of the wire) the client's socket follows, on which it sends
    its stdin, stdout and stderr; with `frame` False the output goes to the job's log.
    `restart`: how many times the command ran before (`--restart on-failure`); a rerun asks
    its client for the stdin, stdout and stderr again (`{"stdio": true}` on its socket)."""

    op: ClassVar[str] = "script"
    interpreter: str
    argv: tuple[str, ...]
    env: dict[str, str]
    resume_dir: str | None
    frame: bool | None = None
    restart: int = 0

    def __post_init__(self) -> None:
        if self.restart < 0:
            raise ValueError(f"executor message 'script': field 'restart' must be a "
                             f"non-negative integer, got {self.restart}")


RESTARTING = "restarting"  # the `Exit` code that lets a script job's failed run go: it reruns


@dataclass(frozen=True, slots=True)
class Exit:
    """Exit now; direct calls still waiting get the error `code` with `message` (a script
    job's executor tells its client the exit status unless `code` is `RESTARTING`)."""

    op: ClassVar[str] = "exit"
    code: str
    message: str


Request = (Become | Host | Attach | Define | Pull | DirectChannel | Estimate | Run | Step | Lease
           | Place | Load | Restore | Checkpoint | SwapOut | Refuse | Exit | Handover | Adopt
           | Script)


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
Message = Request | Reply

def succeeded(reply: Reply) -> bool:
    """Whether `reply` says its request was done (`Failed`, or `ok` false, says not)."""
    return not isinstance(reply, Failed) and getattr(reply, "ok", True)


def failure(reply: Reply) -> str:
    """What a reply that did not succeed says of why."""
    return str(getattr(reply, "message", None) or "no reason given")


REQUESTS: tuple[type[Request], ...] = typing.get_args(Request)
REPLIES: tuple[type[Reply], ...] = typing.get_args(Reply)
#: what the executor sends unasked, between its replies (it answers no request)
UNSOLICITED: tuple[type[Reply], ...] = (Ready, Ran, Exited, Poisoned, Progress)

__all__ = [
    "Ack",
    "Adopt",
    "Attach",
    "Attached",
    "Become",
    "CachePlace",
    "CallDone",
    "Checkpoint",
    "Checkpointed",
    "Define",
    "DirectChannel",
    "Estimate",
    "Estimated",
    "EstimateFailed",
    "Exit",
    "Exited",
    "Failed",
    "failure",
    "GangPlace",
    "HandedOver",
    "Handover",
    "Host",
    "Lease",
    "Load",
    "Loaded",
    "Message",
    "PipelineOptions",
    "Place",
    "Placed",
    "Poisoned",
    "Progress",
    "Pull",
    "Ran",
    "Ready",
    "Refuse",
    "REPLIES",
    "Reply",
    "Request",
    "REQUESTS",
    "RESTARTING",
    "Restore",
    "Run",
    "Script",
    "Step",
    "StepDone",
    "succeeded",
    "SwapOut",
    "Swapped",
    "UNSOLICITED",
    "Wire",
]
