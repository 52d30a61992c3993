"""What a job was submitted with (`JobRecord.spec`): frozen, one type for every kind of job.

A contract job's spec holds at most its devices, its pod's allocation and its client's
interpreter; a batch job's adds its entrypoint (`path`, `function`), its nodes and a pipeline
split; a script job's its command and its limits (`scripts.spec`). The durable registry keeps
it as JSON (`to_json`: the fields that differ from their defaults) and a restart reads it back
(`from_json`). Reading back ignores names it does not know, so a registry written by a later
salusd still restores here, and takes the entrypoint's text, which older registries wrote
beside its `path` and `function`, as the derived `entrypoint` it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from salus.daemon.wire import typed
from salus.daemon.wire.executor_ops import PipelineOptions


@dataclass(frozen=True)
class JobSpec:
    """`devices`: replicas (a gang above 1); `nodes`: nodes of the cluster a gang spans;
    `allocation`: the Kubernetes allocation of a pod's job (a restart gives it back to that pod
    alone); `python`: a contract job's client's interpreter where it is not the daemon's.

    A batch job: `path` and `function` (its entrypoint), `rendezvous` (a multi-node gang's
    key) and `pipeline` (its split into stages).

    A script job: `command` run in `cwd`; `env` (kept only where the job may run again after a
    restart), `restart` and `max_restarts`, `grace_s` (SIGTERM to SIGKILL), `mem_bytes` (its
    --mem), `time_limit_s` with `signal` sent `signal_before_s` before it, its place in an
    array (`array_index`, `array_job`), and the jobs it runs `after`."""

    devices: int = 1
    nodes: int = 1
    allocation: str | None = None
    python: str | None = None
    path: str | None = None
    function: str | None = None
    rendezvous: str | None = None
    pipeline: PipelineOptions | None = None
    command: tuple[str, ...] = ()
    cwd: str | None = None
    env: dict[str, str] | None = None
    restart: str = "never"
    max_restarts: int | None = None
    grace_s: float | None = None
    mem_bytes: int | None = None
    time_limit_s: float | None = None
    signal: int | None = None
    signal_before_s: float | None = None
    array_index: int | None = None
    array_job: int | None = None
    after: tuple[int, ...] = ()

    @property
    def is_script(self) -> bool:
        """A script job's (its command runs in the executor: `salusd run`, REST scripts)."""
        return bool(self.command)

    @property
    def entrypoint(self) -> str | None:
        """A batch job's `path:function`, None for other jobs."""
        return None if self.path is None else f"{self.path}:{self.function}"

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as JSON values (the typed codec's form,
        `wire/typed.py`)."""
        return typed.to_wire(self)

    @classmethod
    def from_json(cls, data: object) -> JobSpec:
        """A spec `to_json` wrote (or an older salusd: see the module docstring); ValueError
        names a field of the wrong type, or says the spec is not a JSON object."""
        if not isinstance(data, dict):
            raise ValueError(f"job spec: a JSON object, not {data!r:.100}")
        known = {k: v for k, v in data.items() if k in _FIELDS}
        spec: JobSpec = typed.from_wire(cls, known, "job spec", canonical=False)
        if spec.is_script and spec.cwd is None:
            raise ValueError("job spec: a script job's field 'cwd' is missing")
        if (spec.path is None) != (spec.function is None):
            raise ValueError("job spec: a batch job's fields 'path' and 'function' go together")
        return spec


_FIELDS = frozenset(f.name for f in dataclasses.fields(JobSpec))
