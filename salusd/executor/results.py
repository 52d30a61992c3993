"""What a call takes and answers with: its arguments on the job's device, its result on the
host and as a message (compact where it can be), whether it was one of the job's iterations, and
an error's one-line text, its traceback's frames let go."""

from __future__ import annotations

import copy
import dataclasses
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cloudpickle
import torch
from torch import nn
from torch.utils._pytree import tree_map

from salus.daemon.wire import compact
from salus.daemon.wire.codec import Pickled
from salus.daemon.wire.frames import FUNCTION_MASK

_RUNTIME = str(Path(__file__).with_name("runtime.py"))  # where the job's code is called


def is_iteration(request: Any, kinds: Mapping[int, str]) -> bool:
    """Whether running `request` is one of the job's iterations (what the scheduler accounts,
    the daemon counts and a checkpoint's iteration is), given the kinds of the job's defined
    functions by id: a batch job's step (`request` None) always; a client's call when it names
    a function defined as "iteration" (`@remote.iteration`); never an inline function
    (`remote.call`). The one place this is decided: the executor's replies carry it to the
    daemon (`counted`)."""
    if request is None:
        return True
    fid = (request.aux & FUNCTION_MASK if type(request) is compact.Message
           else request.get("fid") if isinstance(request, dict) else None)
    return type(fid) is int and kinds.get(fid) == "iteration"


def result_message(request: Any, result: Any, rng: torch.Tensor | None) -> Any:
    """The reply to a call: compact when the result is a tensor, a float, None or a tuple of
    tensors and the call came compact; else JSON with the result pickled."""
    if type(request) is compact.Message:
        kind, tensors, value = _compact_result(result)
        if kind is not None:
            aux = kind
            if rng is not None:
                aux |= compact.AUX_RNG
                tensors = (*tensors, rng)
            return compact.Message(compact.OP_RESULT, tensors=tensors, aux=aux, value=value)
    reply: dict[str, Any] = {"ok": True, "result": Pickled(result, "the call's result")}
    if rng is not None:
        reply["rng"] = rng
    return reply


def _compact_result(result: Any) -> tuple[int | None, tuple[torch.Tensor, ...], float]:
    if isinstance(result, torch.Tensor) and type(result) is torch.Tensor:
        return compact.KIND_TENSOR, (result,), 0.0
    if result is None:
        return compact.KIND_NONE, (), 0.0
    if type(result) is float or type(result) is int:
        return compact.KIND_FLOAT, (), float(result)
    if type(result) is tuple and len(result) < compact.MAX_TENSORS and all(
            type(t) is torch.Tensor for t in result):
        return compact.KIND_TUPLE, result, 0.0
    return None, (), 0.0


def error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def to_device(obj: Any, device: torch.device) -> Any:
    """A call's arguments on the job's device (modules stay where they are: the job's own
    are there already)."""
    if device.type == "cpu":
        return obj

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=True)
        to = getattr(x, "to", None)
        return to(device) if callable(to) and not isinstance(x, nn.Module) else x

    return tree_map(move, obj)


def to_host(obj: Any, depth: int = 0) -> Any:
    """`obj` with every tensor detached and on the CPU, through lists, tuples (named too),
    dicts (their subclasses, e.g. a `ModelOutput`, copied and filled) and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if depth > 64:
        return obj
    if isinstance(obj, dict):
        out = copy.copy(obj) if type(obj) is not dict else {}
        for key, value in obj.items():
            out[key] = to_host(value, depth + 1)
        return out
    if isinstance(obj, list):
        return [to_host(v, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        items = [to_host(v, depth + 1) for v in obj]
        if hasattr(obj, "_fields"):
            return type(obj)(*items)
        try:
            return type(obj)(items)
        except TypeError:  # a tuple subclass built some other way
            return tuple(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        filled = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(filled, f.name, to_host(getattr(obj, f.name), depth + 1))
        return filled
    return obj


def drop_frames(exc: BaseException) -> None:
    """Detach the tracebacks of `exc` and of the exceptions it chains, once their text is
    taken: the frames they hold keep the call's arguments alive, and the reply keeps `exc`
    until it is sent (an argument lent out of the client's pool would then look kept, and the
    line would copy its arguments from then on)."""
    pending, seen = [exc], set()
    while pending:
        e = pending.pop()
        if id(e) not in seen:
            seen.add(id(e))
            e.__traceback__ = None
            pending += [c for c in (e.__cause__, e.__context__) if c is not None]


def call_error(exc: BaseException) -> dict[str, Any]:
    """The error reply for an exception of the job's own code: its type, message and the job's
    own traceback lines (the executor's frames, those of `runtime.py` that called it, are left
    out)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == _RUNTIME:
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    text = "".join(lines)
    drop_frames(exc)
    reply: dict[str, Any] = {
        "ok": False, "code": "call_failed",
        "message": f"{type(exc).__name__}: {exc}",
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "traceback": text[-20_000:],
    }
    try:
        cloudpickle.dumps(exc)
        reply["exception"] = Pickled(exc, "exception")
    except Exception:  # an exception that cannot travel still has its text
        pass
    return reply
