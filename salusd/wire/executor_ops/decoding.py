"""The JSON dicts the wire carries as messages, every field's type checked."""

from __future__ import annotations

from collections.abc import Callable

from salus.daemon.wire.executor_ops.fields import (
    MISSING,
    bad,
    boolean,
    false,
    integer,
    integer_or_none,
    maybe_boolean,
    maybe_dict,
    maybe_integer,
    maybe_number,
    maybe_text,
    nested,
    number,
    only,
    text,
    text_or_none,
    true,
)
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

# ---- decode: nested values ------------------------------------------------------------------
_GANG_KEYS = frozenset({"rank", "world", "port", "local", "store", "key", "loopback"})


def _gang_place(raw: Wire | None, what: str) -> GangPlace | None:
    if raw is None:
        return None
    what = f"{what}: gang"
    only(raw, what, _GANG_KEYS)
    return GangPlace(integer(raw, what, "rank"), integer(raw, what, "world"),
                     maybe_integer(raw, what, "port"), maybe_integer(raw, what, "local"),
                     maybe_text(raw, what, "store"), maybe_text(raw, what, "key"),
                     maybe_boolean(raw, what, "loopback"))


def _decode_gang(d: Wire, what: str, *, required: bool) -> GangPlace | None:
    if not required and "gang" not in d:
        return None
    raw = nested(d, what, "gang", null=required)
    if raw is None:
        return None
    return _gang_place(raw, what)


def _pipeline(d: Wire) -> PipelineOptions | None:
    raw = nested(d, "'load'", "pipeline", null=True)
    if raw is None:
        return None
    what = "'load': pipeline"
    only(raw, what, frozenset({"placement", "microbatches"}))
    return PipelineOptions(text(raw, what, "placement"), integer(raw, what, "microbatches"))


def _cache(d: Wire) -> CachePlace | None:
    raw = nested(d, "'load'", "cache", null=True)
    if raw is None:
        return None
    what = "'load': cache"
    only(raw, what, frozenset({"dir", "bytes"}))
    return CachePlace(text(raw, what, "dir"), integer(raw, what, "bytes"))


def _keys(*names: str) -> frozenset[str]:
    return frozenset(names)


# ---- decode: requests -----------------------------------------------------------------------
def _become(d: Wire) -> Become:
    w = "'become'"
    only(d, w, _keys("op", "uid", "gid", "groups", "user", "home", "threads"))
    groups = d.get("groups", MISSING)
    if type(groups) is not list or not all(type(g) is int for g in groups):
        raise bad(w, "groups", "a list of ints", groups)
    return Become(integer(d, w, "uid"), integer(d, w, "gid"), tuple(groups), text(d, w, "user"),
                  text(d, w, "home"), integer(d, w, "threads"))


def _host(d: Wire) -> Host:
    w = "'host'"
    only(d, w, _keys("op", "cwd", "estimate", "log"))
    return Host(text_or_none(d, w, "cwd"), boolean(d, w, "estimate"), maybe_text(d, w, "log"))


def _adopt(d: Wire) -> Adopt:
    only(d, "'adopt'", _keys("op", "channel", "pool"))
    if "pool" in d:
        true(d, "'adopt'", "pool")
    return Adopt(boolean(d, "'adopt'", "channel"), "pool" in d)


def _attach(d: Wire) -> Attach:
    only(d, "'attach'", _keys("op", "gang"))
    return Attach(_decode_gang(d, "'attach'", required=True))


def _bare(cls: type[Define | Pull | DirectChannel | Step | SwapOut | Handover]
          ) -> Callable[[Wire], Request]:
    keys = _keys("op")

    def decode(d: Wire) -> Request:
        only(d, repr(cls.op), keys)
        return cls()
    return decode


def _estimate_request(d: Wire) -> Estimate:
    only(d, "'estimate'", _keys("op", "frame"))
    return Estimate(maybe_boolean(d, "'estimate'", "frame"))


_RUN_KEYS = _keys("op", "counted", "frame")


def _run(d: Wire) -> Run:
    only(d, "'run'", _RUN_KEYS)
    return Run(boolean(d, "'run'", "counted"), maybe_boolean(d, "'run'", "frame"))


def _lease(d: Wire) -> Lease:
    only(d, "'lease'", _keys("op", "granted"))
    return Lease(boolean(d, "'lease'", "granted"))


def _place(d: Wire) -> Place:
    w = "'place'"
    only(d, w, _keys("op", "device", "budget_bytes", "slowdown", "uuid", "lane", "lane_bytes",
                      "shared", "mps", "mps_limit_bytes", "workspace_bytes", "mps_threads",
                      "total_bytes"))
    if "shared" in d:
        true(d, w, "shared")
    return Place(text(d, w, "device"), integer(d, w, "budget_bytes"), number(d, w, "slowdown"),
                 maybe_text(d, w, "uuid"), maybe_integer(d, w, "lane"),
                 maybe_integer(d, w, "lane_bytes"), "shared" in d, maybe_text(d, w, "mps"),
                 maybe_integer(d, w, "mps_limit_bytes"), maybe_integer(d, w, "workspace_bytes"),
                 maybe_integer(d, w, "mps_threads"), maybe_integer(d, w, "total_bytes"))


def _load(d: Wire) -> Load:
    w = "'load'"
    only(d, w, _keys("op", "path", "function", "restore", "pipeline", "cache", "dir", "gang",
                      "at"))
    return Load(text(d, w, "path"), text(d, w, "function"), boolean(d, w, "restore"),
                _pipeline(d), _cache(d), text_or_none(d, w, "dir"),
                _decode_gang(d, w, required=False), maybe_integer(d, w, "at"))


def _restore(d: Wire) -> Restore:
    w = "'restore'"
    only(d, w, _keys("op", "dir", "gang", "at"))
    return Restore(text_or_none(d, w, "dir"), _decode_gang(d, w, required=False),
                   maybe_integer(d, w, "at"))


def _checkpoint(d: Wire) -> Checkpoint:
    w = "'checkpoint'"
    only(d, w, _keys("op", "dir", "job"))
    return Checkpoint(text_or_none(d, w, "dir"), integer(d, w, "job"))


def _coded(cls: type[Refuse | Exit]) -> Callable[[Wire], Request]:
    keys, w = _keys("op", "code", "message"), repr(cls.op)

    def decode(d: Wire) -> Request:
        only(d, w, keys)
        return cls(text(d, w, "code"), text(d, w, "message"))
    return decode


def _script(d: Wire) -> Script:
    w = "'script'"
    only(d, w, _keys("op", "interpreter", "argv", "env", "resume_dir", "frame", "restart"))
    argv = d.get("argv", MISSING)
    if type(argv) is not list or not all(type(a) is str for a in argv):
        raise bad(w, "argv", "a list of strings", argv)
    env = d.get("env", MISSING)
    if type(env) is not dict or not all(type(v) is str for v in env.values()):
        raise bad(w, "env", "an object of strings", env)
    restart = d.get("restart", 0)
    if type(restart) is not int or restart < 0:
        raise bad(w, "restart", "a non-negative integer", restart)
    return Script(text(d, w, "interpreter"), tuple(argv), env, text_or_none(d, w, "resume_dir"),
                  maybe_boolean(d, w, "frame"), restart)


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
    only(d, what, keys | {"forward"} if "forward" in d else keys)
    forward = boolean(d, what, "forward") if "forward" in d else False
    if "reason" in d:
        false(d, what, "ok")
        return EstimateFailed(text(d, what, "reason"), forward)
    true(d, what, "ok")
    return Estimated(integer(d, what, "bytes"), text(d, what, "method"), forward,
                     maybe_integer(d, what, "reserved_bytes"))


_ESTIMATE_KEYS = _keys("ok", "bytes", "method", "reason", "reserved_bytes")
_CALL_DONE_KEYS = _keys("ok", "seconds", "peak", "counted", "began", "ended", "message",
                        "cache", "comm", "empty", "forward", "oom")
_STEP_DONE_KEYS = _keys("ok", "seconds", "peak", "counted", "began", "ended", "iteration",
                        "loss", "evaluation", "message", "traceback", "cache", "comm",
                        "forward", "oom")


def _oom(d: Wire, what: str) -> bool:
    """The `oom` flag: true, or left out (False)."""
    if "oom" in d:
        true(d, what, "oom")
    return "oom" in d


def _call_done_reply(d: Wire) -> CallDone:
    w = "'run' reply"
    only(d, w, _CALL_DONE_KEYS)
    if "empty" in d:
        true(d, w, "empty")
    return CallDone(boolean(d, w, "ok"), number(d, w, "seconds"), integer_or_none(d, w, "peak"),
                    boolean(d, w, "counted"), maybe_number(d, w, "began"),
                    maybe_number(d, w, "ended"), maybe_text(d, w, "message"),
                    maybe_dict(d, w, "cache"), maybe_dict(d, w, "comm"), "empty" in d,
                    boolean(d, w, "forward"), _oom(d, w))


def _step_done_reply(d: Wire) -> StepDone:
    w = "'step' reply"
    only(d, w, _STEP_DONE_KEYS)
    ok = boolean(d, w, "ok")
    loss: float | None = None
    if ok:
        v = d.get("loss", MISSING)
        if v is not None:
            loss = number(d, w, "loss")
    elif "loss" in d:
        raise bad(w, "loss", "left out when the step failed", d["loss"])
    evaluation = d.get("evaluation")
    if evaluation is not None and type(evaluation) is not str:
        evaluation = number(d, w, "evaluation")
    return StepDone(ok, number(d, w, "seconds"), integer_or_none(d, w, "peak"),
                    boolean(d, w, "counted"), number(d, w, "began"), number(d, w, "ended"),
                    integer(d, w, "iteration"), loss, evaluation, maybe_text(d, w, "message"),
                    maybe_text(d, w, "traceback"), maybe_dict(d, w, "cache"),
                    maybe_dict(d, w, "comm"), boolean(d, w, "forward"), _oom(d, w))


def _ready_reply(d: Wire) -> Ready:
    w = "'ready'"
    only(d, w, _keys("op", "unsolicited", "counted", "estimate", "forward"))
    false(d, w, "forward")
    raw = d.get("estimate", MISSING)
    if raw is MISSING:
        return Ready(boolean(d, w, "counted"))
    if type(raw) is not dict:
        raise bad(w, "estimate", "an object, or left out", raw)
    if "forward" in raw:
        raise ValueError(f"executor message {w}: field 'estimate' has a 'forward' field")
    return Ready(boolean(d, w, "counted"), _decode_estimate(raw, f"{w}: estimate",
                                                          _ESTIMATE_KEYS))


def _ran_reply(d: Wire) -> Ran:
    w = "'ran'"
    only(d, w, _keys("op", "unsolicited", "calls", "iterations", "failed", "seconds", "peak",
                      "began", "ended", "forward", "oom"))
    false(d, w, "forward")
    return Ran(integer(d, w, "calls"), integer(d, w, "iterations"), integer(d, w, "failed"),
               number(d, w, "seconds"), integer_or_none(d, w, "peak"), number(d, w, "began"),
               number(d, w, "ended"), _oom(d, w))


def _progress_reply(d: Wire) -> Progress:
    w = "'progress'"
    only(d, w, _keys("op", "unsolicited", "step", "max_steps", "loss", "forward"))
    false(d, w, "forward")
    loss = d.get("loss", MISSING)
    return Progress(integer(d, w, "step"), integer_or_none(d, w, "max_steps"),
                    None if loss is None else number(d, w, "loss"))


def _plain_reply(d: Wire, w: str, keys: frozenset[str]) -> bool:
    """Checks a reply's fields against `keys` (with ok and forward) and its ok: the forward
    flag."""
    only(d, w, keys | {"ok", "forward"})
    true(d, w, "ok")
    return boolean(d, w, "forward")


def decode_reply(d: object) -> Reply:
    """The reply or unsolicited message the executor sent as `d`, told apart by its fields
    (each reply type has one the others lack); ValueError names what is wrong."""
    if type(d) is not dict:
        raise ValueError(f"an executor reply is a JSON object, not {type(d).__name__}")
    if "unsolicited" in d:
        true(d, "(unsolicited)", "unsolicited")
        op = d.get("op")
        if op == "ready":
            return _ready_reply(d)
        if op == "ran":
            return _ran_reply(d)
        if op == "exited":
            only(d, "'exited'", _keys("op", "unsolicited", "code", "forward"))
            false(d, "'exited'", "forward")
            return Exited(integer(d, "'exited'", "code"))
        if op == "progress":
            return _progress_reply(d)
        if op == "poisoned":
            only(d, "'poisoned'", _keys("op", "unsolicited", "message", "forward"))
            false(d, "'poisoned'", "forward")
            return Poisoned(text(d, "'poisoned'", "message"))
        raise ValueError(f"unknown unsolicited executor message {op!r}")
    if "handed_over" in d:
        w = "'handover' reply"
        only(d, w, _keys("ok", "handed_over", "channel", "message", "forward", "pool"))
        true(d, w, "handed_over")
        if "pool" in d:
            true(d, w, "pool")
        return HandedOver(boolean(d, w, "ok"), boolean(d, w, "channel"),
                          maybe_text(d, w, "message"), boolean(d, w, "forward"), "pool" in d)
    if "seconds" in d and "path" not in d:
        return _step_done_reply(d) if "iteration" in d else _call_done_reply(d)
    if "placed_reserved_bytes" in d:
        w = "'place' reply"
        forward = _plain_reply(d, w, _keys("placed_reserved_bytes"))
        return Placed(integer(d, w, "placed_reserved_bytes"), forward)
    if "swap" in d:
        w = "'swap' reply"
        forward = _plain_reply(d, w, _keys("swap"))
        swap = d["swap"]
        if type(swap) is not dict or not all(
                type(v) in (int, str) or v is None for v in swap.values()):
            raise bad(w, "swap", "an object of ints, strings and nulls", swap)
        return Swapped(swap, forward)
    if "path" in d:
        w = "'checkpoint' reply"
        forward = _plain_reply(d, w, _keys("iteration", "bytes", "seconds", "path", "time"))
        return Checkpointed(integer(d, w, "iteration"), integer(d, w, "bytes"),
                            number(d, w, "seconds"), text(d, w, "path"), number(d, w, "time"),
                            forward)
    if "threads" in d:
        w = "'attach' reply"
        forward = _plain_reply(d, w, _keys("persistent_bytes", "threads",
                                           "persistent_reserved_bytes"))
        return Attached(integer(d, w, "persistent_bytes"), integer(d, w, "threads"), forward,
                        maybe_integer(d, w, "persistent_reserved_bytes"))
    if "persistent_bytes" in d:
        w = "'load' reply"
        forward = _plain_reply(d, w, _keys("persistent_bytes", "iteration",
                                           "persistent_reserved_bytes"))
        return Loaded(integer(d, w, "persistent_bytes"), integer(d, w, "iteration"), forward,
                      maybe_integer(d, w, "persistent_reserved_bytes"))
    if "method" in d or "reason" in d:
        estimate = _decode_estimate(d, "'estimate' reply", _ESTIMATE_KEYS)
        boolean(d, "'estimate' reply", "forward")
        return estimate
    w = "reply"
    only(d, w, _keys("ok", "message", "forward"))
    if boolean(d, w, "ok"):
        if "message" in d:
            raise bad(w, "message", "left out of an ok reply", d["message"])
        return Ack(boolean(d, w, "forward"))
    return Failed(maybe_text(d, w, "message"), boolean(d, w, "forward"))
