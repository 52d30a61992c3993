"""A job moving between two executor processes of its owner: what the old one sends (`bundle`:
its state, CPU random generator, waiting calls and where it stands in its turn) and how the new
one takes it in (`adopt`). The daemon carries the bundle, and the client's socket and shared
memory beside it (`Executor._handover`; `salusd/supervisor/supervisor.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from salus.daemon.executor.output import Streams
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.executor.slot import Slot
from salus.daemon.wire.channel import PickledPayload


def bundle(slot: Slot) -> dict[str, Any]:
    """What goes with the job, pickled (the runtime's state as `handover_state` gives it). The
    running job must be `slot`'s, so that the CPU generator is its own."""
    return {"state": slot.runtime.handover_state(), "rng": torch.get_rng_state(),
            "queued": list(slot.queue), "asked": slot.turn.asked, "estimated": slot.estimated,
            "cwd": slot.cwd, "log": slot.log}


def adopt(job: int, request: Any, streams: Streams, switch: Callable[[Slot], None]) -> Slot:
    """The job of an `adopt` (its bundle in `request`), hosted here and made the running one
    (`switch`): its state loads in its directory, printing to its output. Raises what stops
    it, with the processes its loading started ended."""
    payload = request.get("bundle") if isinstance(request, dict) else None
    if not isinstance(payload, PickledPayload):
        raise TypeError("'adopt' needs the job's bundle")
    moved = payload.load("the job handed over", own=True)
    slot = Slot(job, JobRuntime(), streams.sink(moved["log"]), moved["cwd"], moved["log"],
                moved["estimated"])
    try:
        switch(slot)
        slot.runtime.take_over(moved["state"])
        torch.set_rng_state(moved["rng"])
        slot.queue.extend(moved["queued"])
        slot.turn.asked = moved["asked"]
    except BaseException:
        slot.group.end()
        raise
    return slot
