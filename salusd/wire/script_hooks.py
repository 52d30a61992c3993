"""The hooks between a script job's own code and the executor that runs it, in one process.

The script's side is the public API (`salus.adapters.script`: `step()`, `report()`,
`under_salusd()`); the executor's side installs the boundary and the progress report before
the script starts (`salusd/executor/script.py`). The state lives here, in a module both sides
import, so that the executor needs nothing of the adapters and the adapters nothing of the
executor. Standard library only: a script whose environment has no torch imports it too.
"""

from __future__ import annotations

from collections.abc import Callable

RESUME_ENV = "SALUS_RESUME_DIR"  # the script's directory for its own checkpoints
BOUNDARY_ENV = "SALUS_BOUNDARY"  # "explicit": only `step()` is a boundary, not optimizer steps

Progress = Callable[[int, int | None, float | None], None]

_boundary: Callable[[], None] | None = None
_progress: Progress | None = None


def step() -> None:
    """An iteration boundary: under salusd the job may wait here for its lane and its
    iteration's time and memory peak are reported; in a direct run, nothing."""
    if _boundary is not None:
        _boundary()


def under_salusd() -> bool:
    """Whether this process is a script job's executor."""
    return _boundary is not None


def report(step: int, max_steps: int | None, loss: float | None) -> None:
    """The framework's own step count, its planned steps and the last logged loss, to salusd
    (in a direct run, nothing)."""
    if _progress is not None:
        _progress(step, max_steps, loss)


def install(boundary: Callable[[], None], progress: Progress) -> None:
    """Called by the executor that runs the script, before the script starts."""
    global _boundary, _progress
    _boundary, _progress = boundary, progress
