"""The daemon↔executor protocol: one frozen type per message, and the JSON dict each one is.

The daemon and a job's executor (`salusd/executor/main.py`) share one socket pair. Every message
is a JSON meta frame, the dict `encode` gives; a request whose op carries the client's own frame
(`attach`, `define`, `pull`, `channel`, a first call's `estimate`, a `run` through the daemon) is
followed by it, in the same `sendmsg` (`client_frame_follows`). The daemon never looks inside that
frame: the executor unpickles it.

Daemon → executor, in the order a job meets them:

- `Become` (from the supervisor, first): who the executor becomes. As root it drops to the
  owner's uid, gid and groups before it receives any job bytes, then changes into `cwd` and sets
  the job's intra-op thread count.
- `Attach` (unpickle the named objects, report their exact bytes), `Define` (a function),
  `Estimate` (fake-tensor peak of the first call), `DirectChannel` (the client's end of its
  direct channel), `Load` (a batch job's entrypoint) or `Restore` (a job's checkpoint after a
  restart).
- `Place` (device and budget, after each admission), `Lease` (granted or taken back), `Run` (one
  call), `Step` (a batch job's iteration), `Pull`, `Checkpoint`, `SwapOut`, `Refuse` (fail the
  direct calls waiting in the executor), `Exit` (from the supervisor: answer nothing more).

Every request but `Become` and `Exit` gets exactly one reply, in order (the daemon matches it
with the oldest unanswered request): `Ack` or `Failed` for most, `CallDone` for `Run`,
`StepDone` for `Step`, `Estimated` or `EstimateFailed`, `Attached`, `Loaded` (for `Load` and
`Restore`), `Checkpointed`. A reply with `forward` true is followed by the frame the daemon hands
to the client as its answer. The executor also speaks unasked (`unsolicited`), between replies:

- `Ready`: a call came on the job's direct channel while it holds no lease; the daemon queues it
  for the job and answers `Run` (without a frame) when the policy picks the job in its lane. The
  first `Ready` carries the call's estimate where the daemon estimates first calls.
- `Ran`: calls that ran at once under the job's lease, reported in batches (at most every 20 ms,
  and before the executor reads any message from the daemon, so every decision sees them):
  calls, iterations, seconds, the largest peak. The daemon takes the lease back (`Lease` false,
  answered once any running call has returned) as soon as the job must share its lane or stop.

Whether a call is one of the job's iterations is decided by the executor (`is_iteration` in
`salusd/executor/runtime.py`), which says so in each `CallDone`, `StepDone`, `Ready` and `Ran`;
`Run.counted` is the daemon's own reading, used only until the reply comes.

`decode_request` and `decode_reply` check every field's type (bools are not ints, ints are taken
for floats) and refuse unknown fields, raising ValueError that names the message and the field;
`encode(decode_…(d)) == d` for every dict the daemon and the executor send. Sizes are bytes,
durations seconds, `began`/`ended` the executor's `time.monotonic()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

Wire = dict[str, Any]

_MISSING: Any = object()
_FRAME_OPS = frozenset({"attach", "define", "pull", "estimate", "run", "channel"})


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
    """Who the executor runs as (uid, gid, groups, user name, home), the directory it starts
    in, its intra-op `threads`, its `job` id, and whether it estimates a job's first direct
    call before asking to run it (`estimate`)."""

    op: ClassVar[str] = "become"
    uid: int
    gid: int
    groups: tuple[int, ...]
    user: str
    home: str
    cwd: str | None
    threads: int
    job: int
    estimate: bool


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
    """Run on torch `device` within `budget_bytes` (persistent bytes plus the lane; enforced
    on CUDA), slowed by the device's simulated `slowdown` factor (1.0: none)."""

    op: ClassVar[str] = "place"
    device: str
    budget_bytes: int
    slowdown: float


@dataclass(frozen=True, slots=True)
class Load:
    """Import a batch job's entrypoint `path`:`function` and hold what it returns; with
    `restore`, go on from the latest checkpoint under `dir`. `pipeline`: run it split into
    stages; `cache`: the owner's data cache; `gang`: this replica's place (None, left out of
    the wire: no gang)."""

    op: ClassVar[str] = "load"
    path: str
    function: str
    restore: bool
    pipeline: PipelineOptions | None
    cache: CachePlace | None
    dir: str | None
    gang: GangPlace | None = None


@dataclass(frozen=True, slots=True)
class Restore:
    """Load an interactive job's latest checkpoint under `dir` (after a restart); `gang` as in
    `Load`."""

    op: ClassVar[str] = "restore"
    dir: str | None
    gang: GangPlace | None = None


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
class Exit:
    """Exit now; direct calls still waiting get the error `code` with `message`."""

    op: ClassVar[str] = "exit"
    code: str
    message: str


Request = (Become | Attach | Define | Pull | DirectChannel | Estimate | Run | Step | Lease | Place
           | Load | Restore | Checkpoint | SwapOut | Refuse | Exit)


# ---- executor → daemon ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ack:
    """Done (`lease`, `refuse`, `define`, `pull`, `channel`, `place`, `swap_out`). `forward`:
    the client's answer follows (in every reply type alike)."""

    forward: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed: `message` says why (None: the forwarded answer says it)."""

    message: str | None
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Estimated:
    """The call's peak ephemeral `bytes`, found by `method` ("fake-tensor")."""

    bytes: int
    method: str
    forward: bool = False


@dataclass(frozen=True, slots=True)
class EstimateFailed:
    """The call cannot run on fake tensors (`reason`): its first real run is measured."""

    reason: str
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Attached:
    """The attached objects hold `persistent_bytes`; the executor runs `threads` intra-op
    threads."""

    persistent_bytes: int
    threads: int
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Loaded:
    """A batch job's entrypoint or a checkpoint was loaded: the state's `persistent_bytes` and
    the iteration it stands at (0: from the start)."""

    persistent_bytes: int
    iteration: int
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """A checkpoint of `iteration` was written to `path`: `bytes` on disk in `seconds`, at
    wall-clock `time` (seconds since the epoch)."""

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
    and `ended` are None)."""

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


@dataclass(frozen=True, slots=True)
class StepDone:
    """A batch job's `Step` returned: as `CallDone`, with the job's `iteration` count after it,
    its `loss` (None when not one number; only when `ok`), its `evaluation` (every N
    iterations, a number or text) and, when its code raised, the `message` and `traceback`."""

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


@dataclass(frozen=True, slots=True)
class Ready:
    """Unsolicited: a direct call waits for a `Run`; whether it is an iteration (`counted`)
    and, for a job's first call where the executor estimates, its estimate."""

    counted: bool
    estimate: Estimated | EstimateFailed | None = None


@dataclass(frozen=True, slots=True)
class Ran:
    """Unsolicited: `calls` ran under the lease (`iterations` of them iterations, `failed`
    failed), the iterations taking `seconds` in all, the largest `peak` (bytes; None: none
    measured); the first `began` and the last `ended`."""

    calls: int
    iterations: int
    failed: int
    seconds: float
    peak: int | None
    began: float
    ended: float


Reply = (Ack | Failed | Estimated | EstimateFailed | Attached | Loaded | Checkpointed | CallDone
         | StepDone | Ready | Ran)
Message = Request | Reply


def client_frame_follows(meta: object) -> bool:
    """Whether the client's frame follows the request meta `meta`, as received (the frame is
    read even when the meta does not decode, so the stream stays in step)."""
    if not isinstance(meta, dict):
        return False
    op = meta.get("op")
    return type(op) is str and op in _FRAME_OPS and bool(meta.get("frame", True))


# ---- encode ---------------------------------------------------------------------------------
def encode(msg: Message) -> Wire:
    """The wire dict of `msg`."""
    return _ENCODERS[type(msg)](msg)


def _gang(g: GangPlace) -> Wire:
    out: Wire = {"rank": g.rank, "world": g.world}
    for key in ("port", "local", "store", "key", "loopback"):
        value = getattr(g, key)
        if value is not None:
            out[key] = value
    return out


def _maybe_gang(out: Wire, g: GangPlace | None) -> Wire:
    if g is not None:
        out["gang"] = _gang(g)
    return out


def _with_frame(out: Wire, frame: bool | None) -> Wire:
    if frame is not None:
        out["frame"] = frame
    return out


def _estimate(e: Estimated | EstimateFailed) -> Wire:
    if type(e) is Estimated:
        return {"ok": True, "bytes": e.bytes, "method": e.method}
    assert type(e) is EstimateFailed
    return {"ok": False, "reason": e.reason}


def _call_done(m: CallDone) -> Wire:
    out: Wire = {"ok": m.ok, "seconds": m.seconds, "peak": m.peak}
    if m.empty:
        out["empty"] = True
    if m.began is not None:
        out["began"] = m.began
    if m.ended is not None:
        out["ended"] = m.ended
    if m.cache is not None:
        out["cache"] = m.cache
    if m.comm is not None:
        out["comm"] = m.comm
    if m.message is not None:
        out["message"] = m.message
    out["counted"] = m.counted
    out["forward"] = m.forward
    return out


def _step_done(m: StepDone) -> Wire:
    out: Wire = {"ok": m.ok}
    if m.ok:
        out["loss"] = m.loss
    out["peak"] = m.peak
    if m.message is not None:
        out["message"] = m.message
    if m.traceback is not None:
        out["traceback"] = m.traceback
    if m.cache is not None:
        out["cache"] = m.cache
    if m.comm is not None:
        out["comm"] = m.comm
    if m.evaluation is not None:
        out["evaluation"] = m.evaluation
    out.update(seconds=m.seconds, began=m.began, ended=m.ended, iteration=m.iteration,
               counted=m.counted, forward=m.forward)
    return out


def _ready(m: Ready) -> Wire:
    out: Wire = {"op": "ready", "unsolicited": True, "counted": m.counted}
    if m.estimate is not None:
        out["estimate"] = _estimate(m.estimate)
    out["forward"] = False
    return out


_ENCODERS: dict[type, Callable[[Any], Wire]] = {
    Become: lambda m: {"op": "become", "uid": m.uid, "gid": m.gid, "groups": list(m.groups),
                       "user": m.user, "home": m.home, "cwd": m.cwd, "threads": m.threads,
                       "job": m.job, "estimate": m.estimate},
    Attach: lambda m: {"op": "attach", "gang": None if m.gang is None else _gang(m.gang)},
    Define: lambda m: {"op": "define"},
    Pull: lambda m: {"op": "pull"},
    DirectChannel: lambda m: {"op": "channel"},
    Estimate: lambda m: _with_frame({"op": "estimate"}, m.frame),
    Run: lambda m: _with_frame({"op": "run", "counted": m.counted}, m.frame),
    Step: lambda m: {"op": "step"},
    Lease: lambda m: {"op": "lease", "granted": m.granted},
    Place: lambda m: {"op": "place", "device": m.device, "budget_bytes": m.budget_bytes,
                      "slowdown": m.slowdown},
    Load: lambda m: _maybe_gang({
        "op": "load", "path": m.path, "function": m.function, "restore": m.restore,
        "pipeline": None if m.pipeline is None else {"placement": m.pipeline.placement,
                                                     "microbatches": m.pipeline.microbatches},
        "cache": None if m.cache is None else {"dir": m.cache.dir, "bytes": m.cache.bytes},
        "dir": m.dir}, m.gang),
    Restore: lambda m: _maybe_gang({"op": "restore", "dir": m.dir}, m.gang),
    Checkpoint: lambda m: {"op": "checkpoint", "dir": m.dir, "job": m.job},
    SwapOut: lambda m: {"op": "swap_out"},
    Refuse: lambda m: {"op": "refuse", "code": m.code, "message": m.message},
    Exit: lambda m: {"op": "exit", "code": m.code, "message": m.message},
    Ack: lambda m: {"ok": True, "forward": m.forward},
    Failed: lambda m: ({"ok": False, "forward": m.forward} if m.message is None else
                       {"ok": False, "message": m.message, "forward": m.forward}),
    Estimated: lambda m: {**_estimate(m), "forward": m.forward},
    EstimateFailed: lambda m: {**_estimate(m), "forward": m.forward},
    Attached: lambda m: {"ok": True, "persistent_bytes": m.persistent_bytes,
                         "threads": m.threads, "forward": m.forward},
    Loaded: lambda m: {"ok": True, "persistent_bytes": m.persistent_bytes,
                       "iteration": m.iteration, "forward": m.forward},
    Checkpointed: lambda m: {"ok": True, "iteration": m.iteration, "bytes": m.bytes,
                             "seconds": m.seconds, "path": m.path, "time": m.time,
                             "forward": m.forward},
    CallDone: _call_done,
    StepDone: _step_done,
    Ready: _ready,
    Ran: lambda m: {"op": "ran", "unsolicited": True, "calls": m.calls,
                    "iterations": m.iterations, "failed": m.failed, "seconds": m.seconds,
                    "peak": m.peak, "began": m.began, "ended": m.ended, "forward": False},
}


# ---- decode: field checks -------------------------------------------------------------------
def _bad(what: str, key: str, want: str, got: Any) -> ValueError:
    if got is _MISSING:
        return ValueError(f"executor message {what}: field {key!r} is missing ({want})")
    return ValueError(f"executor message {what}: field {key!r} must be {want}, got "
                      f"{got!r:.100}")


def _only(d: Wire, what: str, keys: frozenset[str]) -> None:
    if not d.keys() <= keys:
        unknown = sorted(set(d) - keys)
        raise ValueError(f"executor message {what}: unknown field(s) {unknown}; it has "
                         f"{sorted(keys)}")


def _int(d: Wire, what: str, key: str) -> int:
    v = d.get(key, _MISSING)
    if type(v) is int:
        return v
    raise _bad(what, key, "an int", v)


def _int_or_none(d: Wire, what: str, key: str) -> int | None:
    v = d.get(key, _MISSING)
    if v is None or type(v) is int:
        return v
    raise _bad(what, key, "an int or null", v)


def _maybe_int(d: Wire, what: str, key: str) -> int | None:
    """An int when the key is there; None when it is left out."""
    v = d.get(key, _MISSING)
    if v is _MISSING or type(v) is int:
        return None if v is _MISSING else v
    raise _bad(what, key, "an int, or left out", v)


def _float(d: Wire, what: str, key: str) -> float:
    v = d.get(key, _MISSING)
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise _bad(what, key, "a number", v)


def _maybe_float(d: Wire, what: str, key: str) -> float | None:
    v = d.get(key, _MISSING)
    if type(v) is float:
        return v
    if v is _MISSING:
        return None
    if type(v) is int:
        return float(v)
    raise _bad(what, key, "a number, or left out", v)


def _bool(d: Wire, what: str, key: str) -> bool:
    v = d.get(key, _MISSING)
    if type(v) is bool:
        return v
    raise _bad(what, key, "true or false", v)


def _maybe_bool(d: Wire, what: str, key: str) -> bool | None:
    v = d.get(key, _MISSING)
    if v is _MISSING or type(v) is bool:
        return None if v is _MISSING else v
    raise _bad(what, key, "true or false, or left out", v)


def _str(d: Wire, what: str, key: str) -> str:
    v = d.get(key, _MISSING)
    if type(v) is str:
        return v
    raise _bad(what, key, "a string", v)


def _str_or_none(d: Wire, what: str, key: str) -> str | None:
    v = d.get(key, _MISSING)
    if v is None or type(v) is str:
        return v
    raise _bad(what, key, "a string or null", v)


def _maybe_str(d: Wire, what: str, key: str) -> str | None:
    v = d.get(key, _MISSING)
    if v is _MISSING or type(v) is str:
        return None if v is _MISSING else v
    raise _bad(what, key, "a string, or left out", v)


def _maybe_dict(d: Wire, what: str, key: str) -> dict[str, Any] | None:
    v = d.get(key, _MISSING)
    if v is _MISSING or type(v) is dict:
        return None if v is _MISSING else v
    raise _bad(what, key, "an object, or left out", v)


def _object(d: Wire, what: str, key: str, *, null: bool) -> Wire | None:
    v = d.get(key, _MISSING)
    if type(v) is dict or (null and v is None):
        return v
    raise _bad(what, key, "an object or null" if null else "an object", v)


def _true(d: Wire, what: str, key: str) -> None:
    if d.get(key, _MISSING) is not True:
        raise _bad(what, key, "true", d.get(key, _MISSING))


def _false(d: Wire, what: str, key: str) -> None:
    if d.get(key, _MISSING) is not False:
        raise _bad(what, key, "false", d.get(key, _MISSING))


# ---- decode: nested values ------------------------------------------------------------------
_GANG_KEYS = frozenset({"rank", "world", "port", "local", "store", "key", "loopback"})


def _gang_place(raw: Wire | None, what: str) -> GangPlace | None:
    if raw is None:
        return None
    what = f"{what}: gang"
    _only(raw, what, _GANG_KEYS)
    return GangPlace(_int(raw, what, "rank"), _int(raw, what, "world"),
                     _maybe_int(raw, what, "port"), _maybe_int(raw, what, "local"),
                     _maybe_str(raw, what, "store"), _maybe_str(raw, what, "key"),
                     _maybe_bool(raw, what, "loopback"))


def _decode_gang(d: Wire, what: str, *, required: bool) -> GangPlace | None:
    if not required and "gang" not in d:
        return None
    raw = _object(d, what, "gang", null=required)
    if raw is None:
        return None
    return _gang_place(raw, what)


def _pipeline(d: Wire) -> PipelineOptions | None:
    raw = _object(d, "'load'", "pipeline", null=True)
    if raw is None:
        return None
    what = "'load': pipeline"
    _only(raw, what, frozenset({"placement", "microbatches"}))
    return PipelineOptions(_str(raw, what, "placement"), _int(raw, what, "microbatches"))


def _cache(d: Wire) -> CachePlace | None:
    raw = _object(d, "'load'", "cache", null=True)
    if raw is None:
        return None
    what = "'load': cache"
    _only(raw, what, frozenset({"dir", "bytes"}))
    return CachePlace(_str(raw, what, "dir"), _int(raw, what, "bytes"))


def _keys(*names: str) -> frozenset[str]:
    return frozenset(names)


# ---- decode: requests -----------------------------------------------------------------------
def _become(d: Wire) -> Become:
    w = "'become'"
    _only(d, w, _keys("op", "uid", "gid", "groups", "user", "home", "cwd", "threads", "job",
                      "estimate"))
    groups = d.get("groups", _MISSING)
    if type(groups) is not list or not all(type(g) is int for g in groups):
        raise _bad(w, "groups", "a list of ints", groups)
    return Become(_int(d, w, "uid"), _int(d, w, "gid"), tuple(groups), _str(d, w, "user"),
                  _str(d, w, "home"), _str_or_none(d, w, "cwd"), _int(d, w, "threads"),
                  _int(d, w, "job"), _bool(d, w, "estimate"))


def _attach(d: Wire) -> Attach:
    _only(d, "'attach'", _keys("op", "gang"))
    return Attach(_decode_gang(d, "'attach'", required=True))


def _bare(cls: type[Define | Pull | DirectChannel | Step | SwapOut]) -> Callable[[Wire], Request]:
    keys = _keys("op")

    def decode(d: Wire) -> Request:
        _only(d, repr(cls.op), keys)
        return cls()
    return decode


def _estimate_request(d: Wire) -> Estimate:
    _only(d, "'estimate'", _keys("op", "frame"))
    return Estimate(_maybe_bool(d, "'estimate'", "frame"))


_RUN_KEYS = _keys("op", "counted", "frame")


def _run(d: Wire) -> Run:
    _only(d, "'run'", _RUN_KEYS)
    return Run(_bool(d, "'run'", "counted"), _maybe_bool(d, "'run'", "frame"))


def _lease(d: Wire) -> Lease:
    _only(d, "'lease'", _keys("op", "granted"))
    return Lease(_bool(d, "'lease'", "granted"))


def _place(d: Wire) -> Place:
    w = "'place'"
    _only(d, w, _keys("op", "device", "budget_bytes", "slowdown"))
    return Place(_str(d, w, "device"), _int(d, w, "budget_bytes"), _float(d, w, "slowdown"))


def _load(d: Wire) -> Load:
    w = "'load'"
    _only(d, w, _keys("op", "path", "function", "restore", "pipeline", "cache", "dir", "gang"))
    return Load(_str(d, w, "path"), _str(d, w, "function"), _bool(d, w, "restore"),
                _pipeline(d), _cache(d), _str_or_none(d, w, "dir"),
                _decode_gang(d, w, required=False))


def _restore(d: Wire) -> Restore:
    w = "'restore'"
    _only(d, w, _keys("op", "dir", "gang"))
    return Restore(_str_or_none(d, w, "dir"), _decode_gang(d, w, required=False))


def _checkpoint(d: Wire) -> Checkpoint:
    w = "'checkpoint'"
    _only(d, w, _keys("op", "dir", "job"))
    return Checkpoint(_str_or_none(d, w, "dir"), _int(d, w, "job"))


def _coded(cls: type[Refuse | Exit]) -> Callable[[Wire], Request]:
    keys, w = _keys("op", "code", "message"), repr(cls.op)

    def decode(d: Wire) -> Request:
        _only(d, w, keys)
        return cls(_str(d, w, "code"), _str(d, w, "message"))
    return decode


_REQUESTS: dict[str, Callable[[Wire], Request]] = {
    "become": _become, "attach": _attach, "define": _bare(Define), "pull": _bare(Pull),
    "channel": _bare(DirectChannel), "estimate": _estimate_request, "run": _run,
    "step": _bare(Step),
    "lease": _lease, "place": _place, "load": _load, "restore": _restore,
    "checkpoint": _checkpoint, "swap_out": _bare(SwapOut), "refuse": _coded(Refuse),
    "exit": _coded(Exit),
}


def decode_request(d: object) -> Request:
    """The request the daemon sent as `d`; ValueError names what is wrong."""
    if type(d) is not dict:
        raise ValueError(f"an executor message is a JSON object, not {type(d).__name__}")
    op = d.get("op")
    decode = _REQUESTS.get(op) if type(op) is str else None
    if decode is None:
        raise ValueError(f"unknown executor op {op!r}")
    return decode(d)


# ---- decode: replies ------------------------------------------------------------------------
def _decode_estimate(d: Wire, what: str, keys: frozenset[str]) -> Estimated | EstimateFailed:
    _only(d, what, keys | {"forward"} if "forward" in d else keys)
    forward = _bool(d, what, "forward") if "forward" in d else False
    if "reason" in d:
        _false(d, what, "ok")
        return EstimateFailed(_str(d, what, "reason"), forward)
    _true(d, what, "ok")
    return Estimated(_int(d, what, "bytes"), _str(d, what, "method"), forward)


_ESTIMATE_KEYS = _keys("ok", "bytes", "method", "reason")
_CALL_DONE_KEYS = _keys("ok", "seconds", "peak", "counted", "began", "ended", "message",
                        "cache", "comm", "empty", "forward")
_STEP_DONE_KEYS = _keys("ok", "seconds", "peak", "counted", "began", "ended", "iteration",
                        "loss", "evaluation", "message", "traceback", "cache", "comm",
                        "forward")


def _call_done_reply(d: Wire) -> CallDone:
    w = "'run' reply"
    _only(d, w, _CALL_DONE_KEYS)
    if "empty" in d:
        _true(d, w, "empty")
    return CallDone(_bool(d, w, "ok"), _float(d, w, "seconds"), _int_or_none(d, w, "peak"),
                    _bool(d, w, "counted"), _maybe_float(d, w, "began"),
                    _maybe_float(d, w, "ended"), _maybe_str(d, w, "message"),
                    _maybe_dict(d, w, "cache"), _maybe_dict(d, w, "comm"), "empty" in d,
                    _bool(d, w, "forward"))


def _step_done_reply(d: Wire) -> StepDone:
    w = "'step' reply"
    _only(d, w, _STEP_DONE_KEYS)
    ok = _bool(d, w, "ok")
    loss: float | None = None
    if ok:
        v = d.get("loss", _MISSING)
        if v is not None:
            loss = _float(d, w, "loss")
    elif "loss" in d:
        raise _bad(w, "loss", "left out when the step failed", d["loss"])
    evaluation = d.get("evaluation")
    if evaluation is not None and type(evaluation) is not str:
        evaluation = _float(d, w, "evaluation")
    return StepDone(ok, _float(d, w, "seconds"), _int_or_none(d, w, "peak"),
                    _bool(d, w, "counted"), _float(d, w, "began"), _float(d, w, "ended"),
                    _int(d, w, "iteration"), loss, evaluation, _maybe_str(d, w, "message"),
                    _maybe_str(d, w, "traceback"), _maybe_dict(d, w, "cache"),
                    _maybe_dict(d, w, "comm"), _bool(d, w, "forward"))


def _ready_reply(d: Wire) -> Ready:
    w = "'ready'"
    _only(d, w, _keys("op", "unsolicited", "counted", "estimate", "forward"))
    _false(d, w, "forward")
    raw = d.get("estimate", _MISSING)
    if raw is _MISSING:
        return Ready(_bool(d, w, "counted"))
    if type(raw) is not dict:
        raise _bad(w, "estimate", "an object, or left out", raw)
    if "forward" in raw:
        raise ValueError(f"executor message {w}: field 'estimate' has a 'forward' field")
    return Ready(_bool(d, w, "counted"), _decode_estimate(raw, f"{w}: estimate",
                                                          _ESTIMATE_KEYS))


def _ran_reply(d: Wire) -> Ran:
    w = "'ran'"
    _only(d, w, _keys("op", "unsolicited", "calls", "iterations", "failed", "seconds", "peak",
                      "began", "ended", "forward"))
    _false(d, w, "forward")
    return Ran(_int(d, w, "calls"), _int(d, w, "iterations"), _int(d, w, "failed"),
               _float(d, w, "seconds"), _int_or_none(d, w, "peak"), _float(d, w, "began"),
               _float(d, w, "ended"))


def _plain_reply(d: Wire, w: str, keys: frozenset[str]) -> bool:
    """Checks a reply's fields against `keys` (with ok and forward) and its ok: the forward
    flag."""
    _only(d, w, keys | {"ok", "forward"})
    _true(d, w, "ok")
    return _bool(d, w, "forward")


def decode_reply(d: object) -> Reply:
    """The reply or unsolicited message the executor sent as `d`, told apart by its fields
    (each reply type has one the others lack); ValueError names what is wrong."""
    if type(d) is not dict:
        raise ValueError(f"an executor reply is a JSON object, not {type(d).__name__}")
    if "unsolicited" in d:
        _true(d, "(unsolicited)", "unsolicited")
        op = d.get("op")
        if op == "ready":
            return _ready_reply(d)
        if op == "ran":
            return _ran_reply(d)
        raise ValueError(f"unknown unsolicited executor message {op!r}")
    if "seconds" in d and "path" not in d:
        return _step_done_reply(d) if "iteration" in d else _call_done_reply(d)
    if "path" in d:
        w = "'checkpoint' reply"
        forward = _plain_reply(d, w, _keys("iteration", "bytes", "seconds", "path", "time"))
        return Checkpointed(_int(d, w, "iteration"), _int(d, w, "bytes"),
                            _float(d, w, "seconds"), _str(d, w, "path"), _float(d, w, "time"),
                            forward)
    if "threads" in d:
        w = "'attach' reply"
        forward = _plain_reply(d, w, _keys("persistent_bytes", "threads"))
        return Attached(_int(d, w, "persistent_bytes"), _int(d, w, "threads"), forward)
    if "persistent_bytes" in d:
        w = "'load' reply"
        forward = _plain_reply(d, w, _keys("persistent_bytes", "iteration"))
        return Loaded(_int(d, w, "persistent_bytes"), _int(d, w, "iteration"), forward)
    if "method" in d or "reason" in d:
        estimate = _decode_estimate(d, "'estimate' reply", _ESTIMATE_KEYS)
        _bool(d, "'estimate' reply", "forward")
        return estimate
    w = "reply"
    _only(d, w, _keys("ok", "message", "forward"))
    if _bool(d, w, "ok"):
        if "message" in d:
            raise _bad(w, "message", "left out of an ok reply", d["message"])
        return Ack(_bool(d, w, "forward"))
    return Failed(_maybe_str(d, w, "message"), _bool(d, w, "forward"))
