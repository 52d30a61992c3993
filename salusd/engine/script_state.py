"""What the engine keeps of a live script job beside its record (`JobRecord.script`): its
command, its reruns and its ranks' ends. The engine's script logic is `scripts.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from salus.daemon.engine.script_command import ScriptCommand


@dataclass(eq=False)
class ScriptState:
    """A live script job's runs: how many reruns it had, why the next one starts (set once
    its failed run's executor is asked to go), and a duplicate of its client's socket (a
    descriptor, kept for reruns while the job may be rerun). A gang's: the ranks at a
    boundary waiting for the gang's next iteration (`ready`), the exit statuses of the
    ranks whose command ended (`exits`, by rank), and whether its time limit runs
    (`limits_armed`: from its command's first start; a daemon restart starts a new state).
    `here`: the descriptor of the link of the executor the caller runs itself (`salusd run
    --here`), until the executor port adopts it."""

    command: ScriptCommand
    restarts: int = 0
    restarting: str = ""
    client_fd: int | None = None
    last_failure: str = ""
    swap: dict[str, Any] = field(default_factory=dict)
    ready: set[int] = field(default_factory=set)
    exits: dict[int, int] = field(default_factory=dict)
    limits_armed: bool = False
    here: int | None = None
