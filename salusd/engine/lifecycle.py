"""A job's lifecycle: its phase and what was asked of it, written only by the transitions here.

The phase is one of `Phase`, in the order a job meets them:

- open: its executors are loading its state (or, replaced after its CUDA context was poisoned,
  its checkpoint);
- attached: its state is loaded; its first call is awaited;
- estimating: its first call is being sized (fake tensors, or measured on its first run);
- submitted: the scheduler has it (waiting for admission, admitted, running);
- ended: finished, cancelled or failed (`end_state`, with a `reason`); nothing changes after.

Beside the phase, a live job may be held (suspended by an operator, or restored after a restart
and awaiting its client), asked to swap out and swapped, asked to stop (a call still running
when it was cancelled), or in a script's grace (its command runs on after SIGTERM). Every
writer of these is a method of `Lifecycle`; the job's record reads them (`JobRecord.phase`
…), and `jobstate.py` says what state they add up to for every reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

EndState = Literal["finished", "cancelled", "failed"]


class Phase(StrEnum):
    OPEN = "open"
    ATTACHED = "attached"
    ESTIMATING = "estimating"
    SUBMITTED = "submitted"
    ENDED = "ended"


@dataclass
class Lifecycle:
    """One job's phase and flags (module docstring); the methods are the transitions."""

    phase: Phase = Phase.OPEN
    held: bool = False  # suspended: by an operator, or awaiting its client after a restart
    awaiting_client: bool = False  # restored interactive job: suspended until its client is back
    swap_requested: bool = False  # suspended with --swap, not yet swapped out
    swapped: bool = False  # its state was moved to host memory
    cancel_requested: bool = False  # ended while a call of it ran: killed if it does not return
    grace: bool = False  # a cancelled script's command runs on after SIGTERM (`Core.end`)
    end_state: EndState | None = None
    reason: str = ""
    ended_s: float | None = None  # on the engine's clock
    ended_at: float | None = None  # unix seconds, as the durable registry's `ended_at`

    @property
    def live(self) -> bool:
        return self.phase is not Phase.ENDED

    def _to(self, phase: Phase) -> None:
        if not self.live:
            raise AssertionError(f"an ended job does not become {phase}")
        self.phase = phase

    # ---- the phase -------------------------------------------------------------------------
    def attached(self) -> None:
        """Its state (or its checkpoint) is loaded in its executors."""
        self._to(Phase.ATTACHED)

    def estimating(self) -> None:
        """Its first call (or iteration) is being sized."""
        self._to(Phase.ESTIMATING)

    def submitted(self) -> None:
        """The scheduler has it."""
        self._to(Phase.SUBMITTED)

    def reopened(self) -> None:
        """It starts over in fresh executors (from its checkpoint): not swapped any more."""
        self._to(Phase.OPEN)
        self.swapped = self.swap_requested = False

    def end(self, state: EndState, reason: str, now: float, wall: float) -> None:
        """It ended (`state`, `reason`) at engine time `now`, unix time `wall`."""
        self._to(Phase.ENDED)
        self.end_state, self.reason, self.ended_s, self.ended_at = state, reason, now, wall

    # ---- what is asked of it -----------------------------------------------------------------
    def suspend(self, swap: bool) -> None:
        """An operator holds it; `swap`: its state is to leave the device (asked of a job the
        scheduler has)."""
        self.held = True
        if self.phase is Phase.SUBMITTED:
            self.swap_requested = self.swap_requested or swap

    def resume(self) -> None:
        """An operator lets it go on; a job the scheduler has comes back in from its swap."""
        self.held = self.swap_requested = False
        if self.phase is Phase.SUBMITTED:
            self.swapped = False

    def await_client(self) -> None:
        """Restored after a restart: held until its client connects again."""
        self.awaiting_client = self.held = True

    def client_back(self) -> None:
        """Its client connected again: it goes on as an operator's `resume` lets it."""
        self.awaiting_client = False
        self.resume()

    def swapped_out(self) -> None:
        """Its executors were asked to move its state to host memory."""
        self.swap_requested, self.swapped = False, True

    def cancelling(self) -> None:
        """It ended while a call of it ran: that call is given a grace to return."""
        self.cancel_requested = True

    def grace_begins(self) -> None:
        self.grace = True

    def grace_over(self) -> None:
        self.grace = False
