"""What an unchanged script run by `salusd run python train.py` may call, and what works the same
in a direct run:

    import salus.adapters.torch as salus   # or, without torch: import salus.adapters.script
    salus.step()            # an iteration boundary (inference loops, custom optimizers)
    salus.resume_dir()      # a directory for the script's own checkpoints
    os.environ["SALUS_JOB_ID"], os.environ["SALUS_JOB_NAME"]  # set under salusd

Under salusd every `torch.optim.Optimizer.step()` is a boundary already (`SALUS_BOUNDARY=explicit`
turns that off, leaving `salus.step()` alone); outside salusd `step()` does nothing. The executor
that runs the script installs the boundary (`salus.daemon.wire.script_hooks`, where the hooks'
state lives); the framework callbacks (`salus.lightning`, `salus.hf`) report through `report`.

This module (and `script_hooks`) imports only the standard library: a script of an environment
without torch (a JAX or numpy loop) marks its boundaries with `salus.adapters.script.step()`,
and `salus.adapters.torch` re-exports the same functions (one state, in `script_hooks`).
"""

from __future__ import annotations

import os

from salus.daemon.wire.script_hooks import BOUNDARY_ENV, RESUME_ENV, report, step, under_salusd

__all__ = ["BOUNDARY_ENV", "RESUME_ENV", "report", "resume_dir", "step", "under_salusd"]


def resume_dir() -> str:
    """A directory of this job's that survives a salusd restart and `--restart on-failure`
    reruns (`$SALUS_RESUME_DIR`); in a direct run `./salus-resume`, made when first asked."""
    path = os.environ.get(RESUME_ENV) or os.path.join(os.getcwd(), "salus-resume")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path
