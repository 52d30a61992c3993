"""A contract or batch job's side of its turn (`turns.JobKind`): its calls run in the
executor's loop (`main.py`), and its state is the executor's to move and swap. A script job's
side is `script.py`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from salus.daemon.executor.calls import handle
from salus.daemon.executor.results import error_text
from salus.daemon.executor.slot import Slot
from salus.daemon.services.slowdown import check_factor
from salus.daemon.wire.executor_ops import (
    Ack,
    DirectChannel,
    Failed,
    Handover,
    Place,
    Placed,
    Reply,
    Request,
    Run,
    Step,
    Swapped,
)

if TYPE_CHECKING:
    from salus.daemon.executor.main import Executor


class Contract:
    """A contract or batch job's side of its turn (`turns.JobKind`): its calls run in this
    loop, its state is the executor's to move."""

    def __init__(self, executor: Executor, slot: Slot) -> None:
        self.executor, self.slot = executor, slot
        self.job, self.turn = slot.job, slot.turn

    def run(self) -> Reply | None:
        return self.executor._run_granted(self.slot)

    def refuse(self, code: str, message: str) -> Reply | None:
        self.executor._refuse_queued(self.slot, code, message)
        return Ack()

    def exit(self, code: str, message: str) -> Reply | None:
        self.executor._refuse_queued(self.slot, code, message)
        self.executor._drop(self.slot)
        return Ack()

    def place(self, device: str, message: Place) -> Reply:
        """Move the job's state to `device`; on a GPU, what the move made the process reserve
        goes back to the daemon (`Placed`)."""
        self.executor._switch(self.slot)
        runtime = self.slot.runtime
        gpu = device.startswith("cuda")
        before = torch.cuda.memory_reserved(device) if gpu else 0  # 0 before CUDA started
        try:
            runtime.place(device, message.budget_bytes, check_factor(message.slowdown))
        except Exception as exc:
            return Failed(error_text(exc)[:2000])
        self.slot.lane_bytes = message.lane_bytes or 0
        self.slot.shared_lane = message.shared
        if runtime.cuda is not None and (grew := torch.cuda.memory_reserved(device) - before):
            return Placed(max(0, grew))
        return Ack()

    def swap_out(self) -> Reply:
        """Move the job's state to host memory; on a GPU, say what it left on the device
        beside what the process's other jobs hold (`left_behind.py`)."""
        self.executor._switch(self.slot)
        others = [obj for other in self.executor.slots.values() if other is not self.slot
                  for obj in vars(other.runtime.state).values()]
        try:
            return Swapped(self.slot.runtime.swap_out(others))
        except Exception as exc:
            return Failed(error_text(exc)[:2000])

    def other(self, message: Request, request: Any) -> tuple[Reply | None, Any]:
        executor, slot = self.executor, self.slot
        match message:
            case DirectChannel():
                executor._open_channel(slot, request)
                return None, None
            case Handover():
                executor._handover(slot)
                return None, None
        executor._switch(slot)
        reply, forward = handle(slot.runtime, message, request)
        if isinstance(message, Run | Step):
            executor._after_call(slot)
        return reply, forward
