"""Daemon → executor: the requests of the executor protocol, one frozen type each, and the
values they nest (see the package's docstring for the protocol)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import ClassVar

from salus.daemon.wire.typed import Wire


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
    client_frame: ClassVar[bool] = True  # the client's frame follows (`client_frame_follows`)
    channel: bool
    pool: bool = False


@dataclass(frozen=True, slots=True)
class Attach:
    """Load the client's named objects (in the frame that follows); a gang's replica joins its
    gang's process group first (`gang`: its place; None for a job of one executor)."""

    op: ClassVar[str] = "attach"
    client_frame: ClassVar[bool] = True  # the client's frame follows (`client_frame_follows`)
    gang: GangPlace | None


@dataclass(frozen=True, slots=True)
class Define:
    """Hold the function in the frame that follows (its id, kind and pickled body)."""

    op: ClassVar[str] = "define"
    client_frame: ClassVar[bool] = True  # the client's frame follows (`client_frame_follows`)


@dataclass(frozen=True, slots=True)
class Pull:
    """Send the named objects of the frame that follows back to the client."""

    op: ClassVar[str] = "pull"
    client_frame: ClassVar[bool] = True  # the client's frame follows (`client_frame_follows`)


@dataclass(frozen=True, slots=True)
class DirectChannel:
    """Serve the job's direct channel: the client's socket travels with the frame that
    follows."""

    op: ClassVar[str] = "channel"
    client_frame: ClassVar[bool] = True  # the client's frame follows (`client_frame_follows`)


@dataclass(frozen=True, slots=True)
class Estimate:
    """The peak ephemeral bytes of a call run on fake tensors: the client's call in the frame
    that follows, or (`frame` False) a batch job's next batch. `frame` None leaves the key out,
    which means a frame follows."""

    op: ClassVar[str] = "estimate"
    client_frame: ClassVar[bool] = True  # the client's frame follows (`client_frame_follows`)
    frame: bool | None = None


@dataclass(frozen=True, slots=True)
class Run:
    """Run one call: the client's, in the frame that follows (`frame` true or None, which
    leaves the key out, as a gang's calls are sent), or (`frame` False) the oldest direct call
    waiting in the executor. `counted` is the daemon's reading of whether it is an iteration;
    the executor decides (`CallDone.counted`)."""

    op: ClassVar[str] = "run"
    client_frame: ClassVar[bool] = True  # the client's frame follows (`client_frame_follows`)
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
    client_frame: ClassVar[bool] = True  # the client's frame follows (`client_frame_follows`)
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


@dataclass(frozen=True, slots=True)
class Signal:
    """Raise signal `signum` in the job's script at once, as salusd's `kill(2)` of a forked
    executor would. Sent, unanswered, to an executor salusd did not fork and cannot `kill`: the
    one `salusd run --here` runs in its own process, maybe in a pod's pid namespace
    (`salusd/executor/in_pod.py`, which reads it as it comes)."""

    op: ClassVar[str] = "signal"
    signum: int

    def __post_init__(self) -> None:
        if not 0 < self.signum < 65:
            raise ValueError(f"executor message 'signal': field 'signum' must be a signal "
                             f"number in 1..64, got {self.signum}")


Request = (Become | Host | Attach | Define | Pull | DirectChannel | Estimate | Run | Step | Lease
           | Place | Load | Restore | Checkpoint | SwapOut | Refuse | Exit | Handover | Adopt
           | Script | Signal)


REQUESTS: tuple[type[Request], ...] = typing.get_args(Request)


__all__ = [
    "Adopt",
    "Attach",
    "Become",
    "CachePlace",
    "Checkpoint",
    "Define",
    "DirectChannel",
    "Estimate",
    "Exit",
    "GangPlace",
    "Handover",
    "Host",
    "Lease",
    "Load",
    "PipelineOptions",
    "Place",
    "Pull",
    "Refuse",
    "Request",
    "REQUESTS",
    "RESTARTING",
    "Restore",
    "Run",
    "Script",
    "Signal",
    "Step",
    "SwapOut",
    "Wire",
]
