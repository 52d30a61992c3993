"""Script jobs: `salusd run python train.py` and `POST /v1/jobs {"command"}`.

A script job is an interactive job whose one executor runs the caller's command unchanged
(`salusd/executor/script.py`) instead of serving a client's calls. Its iteration boundaries
reach the engine as direct calls do (`Ready` / `Run` / `Lease` / `Ran`), so admission, leases,
policies, suspend, resume, cancel and priority treat it as any interactive job. It ends when
its command exits (`Exited`): finished with status 0, failed otherwise. Its process cannot
outlive the daemon: after a restart the job is reported failed, saying so, or with
`--restart on-failure` its command runs again (output to the job's log); its checkpoints are
its own, in `salus.resume_dir()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from salus.daemon.engine.core import Core
from salus.daemon.engine.outbox import Sent
from salus.daemon.engine.registry import MAX_ITERATIONS, JobRecord
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import Script
from salus.daemon.wire.frames import RawFrame

RESTART_POLICIES = ("never", "on-failure")
MAX_ARGS = 4096
MAX_ENV_BYTES = 1 << 20


@dataclass(frozen=True)
class ScriptCommand:
    """What the caller runs: `command` (its interpreter first, as resolved in the caller's
    shell), in directory `cwd`, with environment `env`, and its restart policy."""

    command: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    restart: str = "never"


def check(command: object, cwd: object, env: object, restart: object) -> ScriptCommand:
    """A `ScriptCommand` from a request's fields; BadRequest names what is wrong."""
    if (not isinstance(command, list) or not 2 <= len(command) <= MAX_ARGS
            or not all(isinstance(a, str) and "\0" not in a for a in command)):
        raise BadRequest(f"'command' must be a list of 2 to {MAX_ARGS} strings: the "
                         "interpreter and its arguments, e.g. [\"python\", \"train.py\"]")
    if not isinstance(cwd, str) or not os.path.isabs(cwd) or len(cwd) > 4096:
        raise BadRequest("'cwd' must be an absolute path of at most 4096 characters")
    if env is None:
        env = {}
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadRequest("'env' must be an object of strings")
    if sum(len(k) + len(v) for k, v in env.items()) > MAX_ENV_BYTES:
        raise BadRequest(f"'env' holds more than {MAX_ENV_BYTES} characters")
    if restart not in RESTART_POLICIES:
        raise BadRequest(f"'restart' must be one of {list(RESTART_POLICIES)}, not {restart!r}")
    return ScriptCommand(tuple(command), cwd, dict(env), str(restart))


def spec(command: ScriptCommand) -> dict[str, Any]:
    """What the durable registry keeps of the job: the environment only where the job may be
    rerun after a restart (`on-failure`), which needs it."""
    out: dict[str, Any] = {"command": list(command.command), "cwd": command.cwd,
                           "restart": command.restart}
    if command.restart == "on-failure":
        out["env"] = command.env
    return out


def is_script(record: JobRecord) -> bool:
    return "command" in record.spec


def start(core: Core, record: JobRecord, command: ScriptCommand,
          frame: RawFrame | None) -> None:
    """Give the job an executor and start its command there; `frame` carries the client's
    socket (None: no client, the output goes to the job's log)."""
    core.outbox.acquire(record, 1)
    record.direct = True  # its boundaries come from its executor, as a direct channel's calls
    resume = (None if record.checkpoint_dir is None
              else os.path.join(record.checkpoint_dir, "resume"))

    def started(meta: dict[str, Any]) -> None:
        if not record.live:
            return
        if meta.get("ok"):
            record.phase = "attached"
        else:
            core.end(record, "failed", "the script could not start: "
                     f"{str(meta.get('message', 'no reason given'))[:2000]}")

    script = Script(command.command[0], command.command[1:], command.env, resume,
                    None if frame is not None else False)
    core.outbox.send(record, Sent("script", on_done=started), script, frame)


def exited(core: Core, record: JobRecord, meta: dict[str, Any]) -> None:
    """The job's command exited with `meta["code"]`: the job ends."""
    code = int(meta.get("code", 1))
    if record.live:
        core.end(record, "finished" if code == 0 else "failed",
                 f"its command exited with status {code}: {_shown(record)}")


def progress(core: Core, record: JobRecord, meta: dict[str, Any]) -> None:
    """A framework callback's report: its step, planned steps (the job's planned iterations,
    which SRTF reads) and last logged loss."""
    loss = meta.get("loss")
    if isinstance(loss, int | float):
        record.last_loss = float(loss)
    max_steps = meta.get("max_steps")
    if (isinstance(max_steps, int) and 0 < max_steps <= MAX_ITERATIONS
            and max_steps != record.planned_iterations):
        record.planned_iterations = max_steps
        if core.dispatch.job(record.job_id) is not None:
            core.dispatch.set_total(record.job_id, max_steps)


def restored(core: Core, record: JobRecord) -> None:
    """The daemon restarted while the job's command ran: its process is gone. With
    `--restart on-failure` the command runs again (its output to the job's log), else the job
    fails saying so."""
    why = (f"salusd restarted while job {record.job_id} ran its command "
           f"({_shown(record)}), whose process ended with it")
    if record.spec.get("restart") != "on-failure":
        core.end(record, "failed", why + "; run it with --restart on-failure (and keep its "
                 "checkpoints in salus.resume_dir()) to have it rerun")
        return
    core.event("restart", record.job_id, reason=why)
    start(core, record, ScriptCommand(tuple(record.spec["command"]), str(record.spec["cwd"]),
                                      dict(record.spec.get("env", {})), "on-failure"), None)


def _shown(record: JobRecord) -> str:
    """The command as a person would type it (its first 200 characters)."""
    text = " ".join([os.path.basename(record.spec["command"][0]),
                     *record.spec["command"][1:]])
    return text if len(text) <= 200 else text[:197] + "..."
