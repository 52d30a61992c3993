"""What an unchanged script run by `salusd run python train.py` may call, and what works the same
in a direct run:

    import salus.adapters.torch as salus   # or, without torch: import salus.adapters.script
    salus.step()            # an iteration boundary (inference loops, custom optimizers)
    salus.resume_dir()      # a directory for the script's own checkpoints
    os.environ["SALUS_JOB_ID"], os.environ["SALUS_JOB_NAME"]  # set under salusd

Under salusd every `torch.optim.Optimizer.step()` is a boundary already (`SALUS_BOUNDARY=explicit`
turns that off, leaving `salus.step()` alone); outside salusd `step()` does nothing. The executor
that runs the script installs the boundary (`install`); the framework callbacks
(`salus.lightning`, `salus.hf`) report through `report`.

This module imports only the standard library: a script of an environment without torch (a
JAX or numpy loop) marks its boundaries with `salus.adapters.script.step()`, and
`salus.adapters.torch` re-exports the same functions (one state: `install` reaches both).
"""

from __future__ import annotations

import os
from collections.abc import Callable

RESUME_ENV = "SALUS_RESUME_DIR"
BOUNDARY_ENV = "SALUS_BOUNDARY"

_boundary: Callable[[], None] | None = None
_progress: Callable[[int, int | None, float | None], None] | None = None


def step() -> None:
    """Mark an iteration boundary: under salusd the job may wait here for its lane and its
    iteration's time and memory peak are reported; in a direct run, nothing."""
    if _boundary is not None:
        _boundary()


def resume_dir() -> str:
    """A directory of this job's that survives a salusd restart and `--restart on-failure`
    reruns (`$SALUS_RESUME_DIR`); in a direct run `./salus-resume`, made when first asked."""
    path = os.environ.get(RESUME_ENV) or os.path.join(os.getcwd(), "salus-resume")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def under_salusd() -> bool:
    """Whether this process is a script job's executor."""
    return _boundary is not None


def report(step: int, max_steps: int | None, loss: float | None) -> None:
    """Tell salusd the framework's own step count, its planned steps and the last logged loss
    (a framework callback calls this; in a direct run it does nothing)."""
    if _progress is not None:
        _progress(step, max_steps, loss)


def install(boundary: Callable[[], None],
            progress: Callable[[int, int | None, float | None], None]) -> None:
    """Called by the executor that runs the script, before the script starts."""
    global _boundary, _progress
    _boundary, _progress = boundary, progress
