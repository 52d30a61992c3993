"""Each message as the JSON dict the wire carries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from salus.daemon.wire.executor_ops.messages import (
    Ack,
    Adopt,
    Attach,
    Attached,
    Become,
    CallDone,
    Checkpoint,
    Checkpointed,
    Define,
    DirectChannel,
    Estimate,
    Estimated,
    EstimateFailed,
    Exit,
    Exited,
    Failed,
    GangPlace,
    HandedOver,
    Handover,
    Host,
    Lease,
    Load,
    Loaded,
    Message,
    Place,
    Placed,
    Poisoned,
    Progress,
    Pull,
    Ran,
    Ready,
    Refuse,
    Restore,
    Run,
    Script,
    Step,
    StepDone,
    SwapOut,
    Swapped,
    Wire,
)

_FRAME_OPS = frozenset({"attach", "define", "pull", "estimate", "run", "channel", "adopt",
                        "script"})


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


def _at(at: int | None) -> Wire:
    return {} if at is None else {"at": at}


def _with_reserved(out: Wire, key: str, nbytes: int | None) -> Wire:
    if nbytes is not None:
        out[key] = nbytes
    return out


def _with_frame(out: Wire, frame: bool | None) -> Wire:
    if frame is not None:
        out["frame"] = frame
    return out


def _estimate(e: Estimated | EstimateFailed) -> Wire:
    if type(e) is Estimated:
        return _with_reserved({"ok": True, "bytes": e.bytes, "method": e.method},
                              "reserved_bytes", e.reserved_bytes)
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
    if m.oom:
        out["oom"] = True
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
    if m.oom:
        out["oom"] = True
    out.update(seconds=m.seconds, began=m.began, ended=m.ended, iteration=m.iteration,
               counted=m.counted, forward=m.forward)
    return out


def _ran(m: Ran) -> Wire:
    out: Wire = {"op": "ran", "unsolicited": True, "calls": m.calls, "iterations": m.iterations,
                 "failed": m.failed, "seconds": m.seconds, "peak": m.peak, "began": m.began,
                 "ended": m.ended}
    if m.oom:
        out["oom"] = True
    out["forward"] = False
    return out


def _place(m: Place) -> Wire:
    out: Wire = {"op": "place", "device": m.device, "budget_bytes": m.budget_bytes,
                 "slowdown": m.slowdown}
    for key in ("uuid", "lane", "lane_bytes", "mps", "mps_limit_bytes", "workspace_bytes",
                "mps_threads", "total_bytes"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    if m.shared:
        out["shared"] = True
    return out


def _handed_over(m: HandedOver) -> Wire:
    out: Wire = {"ok": m.ok, "handed_over": True, "channel": m.channel}
    if m.pool:
        out["pool"] = True
    if m.message is not None:
        out["message"] = m.message
    out["forward"] = m.forward
    return out


def _ready(m: Ready) -> Wire:
    out: Wire = {"op": "ready", "unsolicited": True, "counted": m.counted}
    if m.estimate is not None:
        out["estimate"] = _estimate(m.estimate)
    out["forward"] = False
    return out


_ENCODERS: dict[type, Callable[[Any], Wire]] = {
    Become: lambda m: {"op": "become", "uid": m.uid, "gid": m.gid, "groups": list(m.groups),
                       "user": m.user, "home": m.home, "threads": m.threads},
    Host: lambda m: {"op": "host", "cwd": m.cwd, "estimate": m.estimate,
                     **({} if m.log is None else {"log": m.log})},
    Handover: lambda m: {"op": "handover"},
    Adopt: lambda m: {"op": "adopt", "channel": m.channel, **({"pool": True} if m.pool else {})},
    Attach: lambda m: {"op": "attach", "gang": None if m.gang is None else _gang(m.gang)},
    Define: lambda m: {"op": "define"},
    Pull: lambda m: {"op": "pull"},
    DirectChannel: lambda m: {"op": "channel"},
    Estimate: lambda m: _with_frame({"op": "estimate"}, m.frame),
    Run: lambda m: _with_frame({"op": "run", "counted": m.counted}, m.frame),
    Step: lambda m: {"op": "step"},
    Lease: lambda m: {"op": "lease", "granted": m.granted},
    Place: _place,
    Load: lambda m: _maybe_gang({
        "op": "load", "path": m.path, "function": m.function, "restore": m.restore,
        "pipeline": None if m.pipeline is None else {"placement": m.pipeline.placement,
                                                     "microbatches": m.pipeline.microbatches},
        "cache": None if m.cache is None else {"dir": m.cache.dir, "bytes": m.cache.bytes},
        "dir": m.dir, **_at(m.at)}, m.gang),
    Restore: lambda m: _maybe_gang({"op": "restore", "dir": m.dir, **_at(m.at)}, m.gang),
    Checkpoint: lambda m: {"op": "checkpoint", "dir": m.dir, "job": m.job},
    SwapOut: lambda m: {"op": "swap_out"},
    Refuse: lambda m: {"op": "refuse", "code": m.code, "message": m.message},
    Exit: lambda m: {"op": "exit", "code": m.code, "message": m.message},
    Script: lambda m: _with_frame({"op": "script", "interpreter": m.interpreter,
                                   "argv": list(m.argv), "env": dict(m.env),
                                   "resume_dir": m.resume_dir,
                                   **({"restart": m.restart} if m.restart else {})}, m.frame),
    Ack: lambda m: {"ok": True, "forward": m.forward},
    Failed: lambda m: ({"ok": False, "forward": m.forward} if m.message is None else
                       {"ok": False, "message": m.message, "forward": m.forward}),
    Estimated: lambda m: {**_estimate(m), "forward": m.forward},
    EstimateFailed: lambda m: {**_estimate(m), "forward": m.forward},
    Attached: lambda m: _with_reserved({"ok": True, "persistent_bytes": m.persistent_bytes,
                                        "threads": m.threads, "forward": m.forward},
                                       "persistent_reserved_bytes", m.persistent_reserved_bytes),
    Loaded: lambda m: _with_reserved({"ok": True, "persistent_bytes": m.persistent_bytes,
                                      "iteration": m.iteration, "forward": m.forward},
                                     "persistent_reserved_bytes", m.persistent_reserved_bytes),
    Checkpointed: lambda m: {"ok": True, "iteration": m.iteration, "bytes": m.bytes,
                             "seconds": m.seconds, "path": m.path, "time": m.time,
                             "forward": m.forward},
    HandedOver: _handed_over,
    CallDone: _call_done,
    StepDone: _step_done,
    Ready: _ready,
    Ran: _ran,
    Exited: lambda m: {"op": "exited", "unsolicited": True, "code": m.code, "forward": False},
    Poisoned: lambda m: {"op": "poisoned", "unsolicited": True, "message": m.message,
                         "forward": False},
    Progress: lambda m: {"op": "progress", "unsolicited": True, "step": m.step,
                         "max_steps": m.max_steps, "loss": m.loss, "forward": False},
    Swapped: lambda m: {"ok": True, "swap": dict(m.swap), "forward": m.forward},
    Placed: lambda m: {"ok": True, "placed_reserved_bytes": m.reserved_bytes,
                       "forward": m.forward},
}
