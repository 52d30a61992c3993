"""What a call answers with: its result as a message (compact where it can be), whether it was
one of the job's iterations, and an error's one-line text."""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

import torch

from salus.daemon.wire import compact
from salus.daemon.wire.codec import Pickled
from salus.daemon.wire.frames import FUNCTION_MASK


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
