"""The JSON dicts the wire carries as messages, every field's type checked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from salus.daemon.wire.executor_ops.messages import (
    Ack,
    Adopt,
    Attach,
    Attached,
    Become,
    CachePlace,
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
    PipelineOptions,
    Place,
    Placed,
    Poisoned,
    Progress,
    Pull,
    Ran,
    Ready,
    Refuse,
    Reply,
    Request,
    Restore,
    Run,
    Script,
    Step,
    StepDone,
    SwapOut,
    Swapped,
    Wire,
)

_MISSING: Any = object()


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
    _only(d, w, _keys("op", "uid", "gid", "groups", "user", "home", "threads"))
    groups = d.get("groups", _MISSING)
    if type(groups) is not list or not all(type(g) is int for g in groups):
        raise _bad(w, "groups", "a list of ints", groups)
    return Become(_int(d, w, "uid"), _int(d, w, "gid"), tuple(groups), _str(d, w, "user"),
                  _str(d, w, "home"), _int(d, w, "threads"))


def _host(d: Wire) -> Host:
    w = "'host'"
    _only(d, w, _keys("op", "cwd", "estimate", "log"))
    return Host(_str_or_none(d, w, "cwd"), _bool(d, w, "estimate"), _maybe_str(d, w, "log"))


def _adopt(d: Wire) -> Adopt:
    _only(d, "'adopt'", _keys("op", "channel", "pool"))
    if "pool" in d:
        _true(d, "'adopt'", "pool")
    return Adopt(_bool(d, "'adopt'", "channel"), "pool" in d)


def _attach(d: Wire) -> Attach:
    _only(d, "'attach'", _keys("op", "gang"))
    return Attach(_decode_gang(d, "'attach'", required=True))


def _bare(cls: type[Define | Pull | DirectChannel | Step | SwapOut | Handover]
          ) -> Callable[[Wire], Request]:
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
    _only(d, w, _keys("op", "device", "budget_bytes", "slowdown", "uuid", "lane", "lane_bytes",
                      "shared", "mps", "mps_limit_bytes", "workspace_bytes", "mps_threads",
                      "total_bytes"))
    if "shared" in d:
        _true(d, w, "shared")
    return Place(_str(d, w, "device"), _int(d, w, "budget_bytes"), _float(d, w, "slowdown"),
                 _maybe_str(d, w, "uuid"), _maybe_int(d, w, "lane"),
                 _maybe_int(d, w, "lane_bytes"), "shared" in d, _maybe_str(d, w, "mps"),
                 _maybe_int(d, w, "mps_limit_bytes"), _maybe_int(d, w, "workspace_bytes"),
                 _maybe_int(d, w, "mps_threads"), _maybe_int(d, w, "total_bytes"))


def _load(d: Wire) -> Load:
    w = "'load'"
    _only(d, w, _keys("op", "path", "function", "restore", "pipeline", "cache", "dir", "gang",
                      "at"))
    return Load(_str(d, w, "path"), _str(d, w, "function"), _bool(d, w, "restore"),
                _pipeline(d), _cache(d), _str_or_none(d, w, "dir"),
                _decode_gang(d, w, required=False), _maybe_int(d, w, "at"))


def _restore(d: Wire) -> Restore:
    w = "'restore'"
    _only(d, w, _keys("op", "dir", "gang", "at"))
    return Restore(_str_or_none(d, w, "dir"), _decode_gang(d, w, required=False),
                   _maybe_int(d, w, "at"))


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


def _script(d: Wire) -> Script:
    w = "'script'"
    _only(d, w, _keys("op", "interpreter", "argv", "env", "resume_dir", "frame", "restart"))
    argv = d.get("argv", _MISSING)
    if type(argv) is not list or not all(type(a) is str for a in argv):
        raise _bad(w, "argv", "a list of strings", argv)
    env = d.get("env", _MISSING)
    if type(env) is not dict or not all(type(v) is str for v in env.values()):
        raise _bad(w, "env", "an object of strings", env)
    restart = d.get("restart", 0)
    if type(restart) is not int or restart < 0:
        raise _bad(w, "restart", "a non-negative integer", restart)
    return Script(_str(d, w, "interpreter"), tuple(argv), env, _str_or_none(d, w, "resume_dir"),
                  _maybe_bool(d, w, "frame"), restart)


_REQUESTS: dict[str, Callable[[Wire], Request]] = {
    "become": _become, "host": _host, "handover": _bare(Handover), "adopt": _adopt,
    "attach": _attach, "define": _bare(Define), "pull": _bare(Pull),
    "channel": _bare(DirectChannel), "estimate": _estimate_request, "run": _run,
    "step": _bare(Step),
    "lease": _lease, "place": _place, "load": _load, "restore": _restore,
    "checkpoint": _checkpoint, "swap_out": _bare(SwapOut), "refuse": _coded(Refuse),
    "exit": _coded(Exit), "script": _script,
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
    return Estimated(_int(d, what, "bytes"), _str(d, what, "method"), forward,
                     _maybe_int(d, what, "reserved_bytes"))


_ESTIMATE_KEYS = _keys("ok", "bytes", "method", "reason", "reserved_bytes")
_CALL_DONE_KEYS = _keys("ok", "seconds", "peak", "counted", "began", "ended", "message",
                        "cache", "comm", "empty", "forward", "oom")
_STEP_DONE_KEYS = _keys("ok", "seconds", "peak", "counted", "began", "ended", "iteration",
                        "loss", "evaluation", "message", "traceback", "cache", "comm",
                        "forward", "oom")


def _oom(d: Wire, what: str) -> bool:
    """The `oom` flag: true, or left out (False)."""
    if "oom" in d:
        _true(d, what, "oom")
    return "oom" in d


def _call_done_reply(d: Wire) -> CallDone:
    w = "'run' reply"
    _only(d, w, _CALL_DONE_KEYS)
    if "empty" in d:
        _true(d, w, "empty")
    return CallDone(_bool(d, w, "ok"), _float(d, w, "seconds"), _int_or_none(d, w, "peak"),
                    _bool(d, w, "counted"), _maybe_float(d, w, "began"),
                    _maybe_float(d, w, "ended"), _maybe_str(d, w, "message"),
                    _maybe_dict(d, w, "cache"), _maybe_dict(d, w, "comm"), "empty" in d,
                    _bool(d, w, "forward"), _oom(d, w))


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
                    _maybe_dict(d, w, "comm"), _bool(d, w, "forward"), _oom(d, w))


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
                      "began", "ended", "forward", "oom"))
    _false(d, w, "forward")
    return Ran(_int(d, w, "calls"), _int(d, w, "iterations"), _int(d, w, "failed"),
               _float(d, w, "seconds"), _int_or_none(d, w, "peak"), _float(d, w, "began"),
               _float(d, w, "ended"), _oom(d, w))


def _progress_reply(d: Wire) -> Progress:
    w = "'progress'"
    _only(d, w, _keys("op", "unsolicited", "step", "max_steps", "loss", "forward"))
    _false(d, w, "forward")
    loss = d.get("loss", _MISSING)
    return Progress(_int(d, w, "step"), _int_or_none(d, w, "max_steps"),
                    None if loss is None else _float(d, w, "loss"))


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
        if op == "exited":
            _only(d, "'exited'", _keys("op", "unsolicited", "code", "forward"))
            _false(d, "'exited'", "forward")
            return Exited(_int(d, "'exited'", "code"))
        if op == "progress":
            return _progress_reply(d)
        if op == "poisoned":
            _only(d, "'poisoned'", _keys("op", "unsolicited", "message", "forward"))
            _false(d, "'poisoned'", "forward")
            return Poisoned(_str(d, "'poisoned'", "message"))
        raise ValueError(f"unknown unsolicited executor message {op!r}")
    if "handed_over" in d:
        w = "'handover' reply"
        _only(d, w, _keys("ok", "handed_over", "channel", "message", "forward", "pool"))
        _true(d, w, "handed_over")
        if "pool" in d:
            _true(d, w, "pool")
        return HandedOver(_bool(d, w, "ok"), _bool(d, w, "channel"), _maybe_str(d, w, "message"),
                          _bool(d, w, "forward"), "pool" in d)
    if "seconds" in d and "path" not in d:
        return _step_done_reply(d) if "iteration" in d else _call_done_reply(d)
    if "placed_reserved_bytes" in d:
        w = "'place' reply"
        forward = _plain_reply(d, w, _keys("placed_reserved_bytes"))
        return Placed(_int(d, w, "placed_reserved_bytes"), forward)
    if "swap" in d:
        w = "'swap' reply"
        forward = _plain_reply(d, w, _keys("swap"))
        swap = d["swap"]
        if type(swap) is not dict or not all(
                type(v) in (int, str) or v is None for v in swap.values()):
            raise _bad(w, "swap", "an object of ints, strings and nulls", swap)
        return Swapped(swap, forward)
    if "path" in d:
        w = "'checkpoint' reply"
        forward = _plain_reply(d, w, _keys("iteration", "bytes", "seconds", "path", "time"))
        return Checkpointed(_int(d, w, "iteration"), _int(d, w, "bytes"),
                            _float(d, w, "seconds"), _str(d, w, "path"), _float(d, w, "time"),
                            forward)
    if "threads" in d:
        w = "'attach' reply"
        forward = _plain_reply(d, w, _keys("persistent_bytes", "threads",
                                           "persistent_reserved_bytes"))
        return Attached(_int(d, w, "persistent_bytes"), _int(d, w, "threads"), forward,
                        _maybe_int(d, w, "persistent_reserved_bytes"))
    if "persistent_bytes" in d:
        w = "'load' reply"
        forward = _plain_reply(d, w, _keys("persistent_bytes", "iteration",
                                           "persistent_reserved_bytes"))
        return Loaded(_int(d, w, "persistent_bytes"), _int(d, w, "iteration"), forward,
                      _maybe_int(d, w, "persistent_reserved_bytes"))
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
