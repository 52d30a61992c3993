"""Script jobs: `salusd run python train.py` and `POST /v1/jobs {"command"}`.

A script job is an interactive job whose one executor runs the caller's command unchanged
(`salusd/executor/script.py`) instead of serving a client's calls. Its iteration boundaries
reach the engine as direct calls do (`Ready` / `Run` / `Lease` / `Ran`), so admission, leases,
policies, suspend, resume, cancel and priority treat it as any interactive job. It ends when
its command exits (`Exited`): finished with status 0, failed otherwise. With `--restart
on-failure` (a Kubernetes Job's `restartPolicy: OnFailure`) a command that exits non-zero, or
whose executor dies, runs again in a fresh executor, at most `max_restarts` times, keeping the
job, its lane and its `salus.resume_dir()`; the client of `salusd run` stays attached across
reruns (the daemon keeps a duplicate of its socket, on which each rerun asks for its stdio). Its
process cannot outlive the daemon: after a restart the job is reported failed, saying so, or
with `on-failure` its command runs again (output to the job's log); its checkpoints are its
own, in `salus.resume_dir()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from salus.daemon.engine.core import Core
from salus.daemon.engine.outbox import Sent
from salus.daemon.engine.registry import MAX_ITERATIONS, JobRecord
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import RESTARTING, Script
from salus.daemon.wire.frames import FLAG_SOCKET, RawFrame, json_frame

RESTART_POLICIES = ("never", "on-failure")
MAX_RESTARTS = 3  # as many as a Kubernetes Job's default backoffLimit would allow, about
MAX_RESTARTS_LIMIT = 1000
MAX_ARGS = 4096
MAX_ENV_BYTES = 1 << 20
JOB_ID_ENV, JOB_NAME_ENV = "SALUS_JOB_ID", "SALUS_JOB_NAME"  # as Slurm's SLURM_JOB_ID, _NAME
MAX_TIME_LIMIT_S = 366 * 86400.0
LIMIT_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                           signal.SIGUSR2})


@dataclass(frozen=True)
class ScriptCommand:
    """What the caller runs: `command` (its interpreter first, as resolved in the caller's
    shell), in directory `cwd`, with environment `env`, and its restart policy; its time limit
    (`time_limit_s`, seconds from its start; None: none) and the signal its command gets
    `signal_before_s` before it (`signal`, a number; None: none), as Slurm's `--time` and
    `--signal`."""

    command: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    restart: str = "never"
    max_restarts: int = MAX_RESTARTS
    time_limit_s: float | None = None
    signal: int | None = None
    signal_before_s: float = 0.0


@dataclass(eq=False)
class ScriptState:
    """A live script job's runs: how many reruns it had, why the next one starts (set once
    its failed run's executor is asked to go), and a duplicate of its client's socket (a
    descriptor, kept for reruns while the job may be rerun)."""

    command: ScriptCommand
    restarts: int = 0
    restarting: str = ""
    client_fd: int | None = None
    last_failure: str = ""
    swap: dict[str, Any] = field(default_factory=dict)


def check(command: object, cwd: object, env: object, restart: object,
          max_restarts: object = MAX_RESTARTS) -> ScriptCommand:
    """A `ScriptCommand` from a request's fields; BadRequest names what is wrong."""
    if (not isinstance(command, list) or not 2 <= len(command) <= MAX_ARGS
            or not all(isinstance(a, str) and "\0" not in a and _encodable(a)
                       for a in command)):
        raise BadRequest(f"'command' must be a list of 2 to {MAX_ARGS} strings (without NUL, "
                         "encodable as UTF-8): the interpreter and its arguments, e.g. "
                         "[\"python\", \"train.py\"]")
    if (not isinstance(cwd, str) or not os.path.isabs(cwd) or len(cwd) > 4096
            or "\0" in cwd or not _encodable(cwd)):
        raise BadRequest("'cwd' must be an absolute path of at most 4096 characters, without "
                         "NUL, encodable as UTF-8")
    if env is None:
        env = {}
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadRequest("'env' must be an object of strings")
    bad = next((k for k, v in env.items()
                if not k or "=" in k or "\0" in k + v or not _encodable(k + v)), None)
    if bad is not None:
        raise BadRequest(f"'env' has the variable {bad!r}: a name must be non-empty, without "
                         "'=' or NUL, and a value without NUL, both encodable as UTF-8")
    if sum(len(k) + len(v) for k, v in env.items()) > MAX_ENV_BYTES:
        raise BadRequest(f"'env' holds more than {MAX_ENV_BYTES} characters")
    if restart not in RESTART_POLICIES:
        raise BadRequest(f"'restart' must be one of {list(RESTART_POLICIES)}, not {restart!r}")
    if type(max_restarts) is not int or not 0 <= max_restarts <= MAX_RESTARTS_LIMIT:
        raise BadRequest(f"'max_restarts' must be an integer from 0 to {MAX_RESTARTS_LIMIT}, "
                         f"not {max_restarts!r}")
    return ScriptCommand(tuple(command), cwd, dict(env), str(restart), max_restarts)


def _encodable(text: str) -> bool:
    """Whether UTF-8 can encode `text` (a lone surrogate cannot reach an environment)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def with_limits(command: ScriptCommand, time_limit_s: object, signum: object,
                before_s: object) -> ScriptCommand:
    """`command` with a request's `time_limit_s`, `signal` and `signal_before_s` (each may be
    left out); BadRequest names what is wrong."""
    if time_limit_s is None and signum is None:
        return command
    limit = _seconds(time_limit_s, "time_limit_s", MAX_TIME_LIMIT_S)
    if signum is not None and (type(signum) is not int or signum not in LIMIT_SIGNALS):
        raise BadRequest(f"'signal' must be one of the signal numbers {sorted(LIMIT_SIGNALS)}")
    before = 0.0 if before_s is None else _seconds(before_s, "signal_before_s", limit)
    return dataclasses.replace(command, time_limit_s=limit,
                               signal=signum if type(signum) is int else None,
                               signal_before_s=before)


def _seconds(value: object, name: str, most: float) -> float:
    if type(value) not in (int, float) or not 0 <= float(value) <= most:  # type: ignore[arg-type]
        raise BadRequest(f"'{name}' must be seconds from 0 to {most:g}")
    return float(value)  # type: ignore[arg-type]


def spec(command: ScriptCommand) -> dict[str, Any]:
    """What the durable registry keeps of the job: the environment only where the job may be
    rerun after a restart (`on-failure`), which needs it."""
    out: dict[str, Any] = {"command": list(command.command), "cwd": command.cwd,
                           "restart": command.restart, "max_restarts": command.max_restarts}
    if command.restart == "on-failure":
        out["env"] = command.env
    return out


def start(core: Core, record: JobRecord, command: ScriptCommand,
          frame: RawFrame | None) -> None:
    """Give the job an executor and start its command there; `frame` carries the client's
    socket (None: no client, the output goes to the job's log)."""
    state = record.script
    if state is None:
        state = record.script = ScriptState(command)
        if frame is not None and frame.fd is not None and command.restart == "on-failure":
            state.client_fd = os.dup(frame.fd)
    core.outbox.acquire(record, 1)
    resume = (None if record.checkpoint_dir is None
              else os.path.join(record.checkpoint_dir, "resume"))

    def started(meta: dict[str, Any]) -> None:
        if not record.live:
            return
        if meta.get("ok"):
            record.direct = True  # its boundaries come from its executor, as direct calls
            record.phase = "attached" if record.phase == "open" else record.phase
        else:
            core.end(record, "failed", "the script could not start: "
                     f"{str(meta.get('message', 'no reason given'))[:2000]}")

    # The job's id and name in its environment, as Slurm's SLURM_JOB_ID and SLURM_JOB_NAME.
    env = {**command.env, JOB_ID_ENV: str(record.job_id), JOB_NAME_ENV: record.name}
    script = Script(command.command[0], command.command[1:], env, resume,
                    None if frame is not None else False, state.restarts)
    core.outbox.send(record, Sent("script", on_done=started), script, frame)


def exited(core: Core, record: JobRecord, meta: dict[str, Any]) -> None:
    """The job's command exited with `meta["code"]`: the job ends, or with `on-failure` and
    reruns left a non-zero status lets its executor go, and the command runs again once it
    is gone (`executor_gone`)."""
    code = int(meta.get("code", 1))
    if not record.live:  # cancelled: its command ended within its grace
        record.grace = False
        core.finalize(record)
        return
    why = f"its command exited with status {code}: {_shown(record)}"
    if code != 0 and may_rerun(core, record):
        assert record.script is not None
        record.script.restarting = why
        record.direct = False  # no lease for the run that ended
        core.outbox.retire_all(record, RESTARTING, why)
        return
    core.end(record, "finished" if code == 0 else "failed", failed_reason(record, why))


def may_rerun(core: Core, record: JobRecord) -> bool:
    """Whether the live job's command runs again after a failure (`on-failure`, reruns left,
    not being cancelled, salusd not stopping)."""
    state = record.script
    return (state is not None and record.live and not core.stopping
            and not record.cancel_requested and state.command.restart == "on-failure"
            and state.restarts < state.command.max_restarts)


def executor_gone(core: Core, record: JobRecord, reason: str) -> bool:
    """The job's executor is gone (`reason`): True when its command is to run again (the
    caller frees what the old run held, then calls `rerun`); else the client's socket the
    daemon kept is closed, so that `salusd run` hears the end."""
    state = record.script
    if state is None:
        return False
    if record.live and not core.stopping and (state.restarting or may_rerun(core, record)):
        state.last_failure = state.restarting or reason
        state.restarting = ""
        return True
    if state.client_fd is not None:
        with contextlib.suppress(OSError):
            os.close(state.client_fd)
        state.client_fd = None
    return False


def rerun(core: Core, record: JobRecord) -> None:
    """Run the job's command again in a fresh executor, in its resume directory, its client
    (if it is still there) attached again."""
    state = record.script
    assert state is not None
    state.restarts += 1
    record.direct = False  # no lease until the new executor runs the script
    record.calls.clear()  # the old run's turn requests (no client waits on them)
    core.dispatch.withdraw(record.job_id)
    core.event("restart", record.job_id, reason=state.last_failure, restarts=state.restarts)
    frame = None
    if state.client_fd is not None:
        frame = json_frame({"op": "rerun"})
        frame.flags |= FLAG_SOCKET
        frame.fd = os.dup(state.client_fd)
    start(core, record, state.command, frame)


def view(record: JobRecord) -> dict[str, Any] | None:
    """What status and info show of a script job (None for any other job)."""
    state = record.script
    if state is None:
        return None
    return {"restart": state.command.restart, "restarts": state.restarts,
            "max_restarts": state.command.max_restarts, "last_failure": state.last_failure,
            "swap": state.swap or None}


def swapped(core: Core, record: JobRecord, swap: dict[str, Any]) -> None:
    """The executor moved what `suspend --swap` reaches of the script to host memory, or back
    (`salusd/executor/script_swap.py`): kept for the job's views."""
    state = record.script
    if state is None:
        return
    back = "moved_back_bytes" in swap
    state.swap = {**(state.swap if back else {}), **swap, "swapped_out": not back}
    core.event("script_swap", record.job_id, **swap)


def failed_reason(record: JobRecord, why: str) -> str:
    """`why` a job failed, with its reruns counted when it is a script job run with
    `on-failure`."""
    state = record.script
    if state is None or state.command.restart != "on-failure":
        return why
    return f"{why} (after {state.restarts} of at most {state.command.max_restarts} restarts)"


def progress(core: Core, record: JobRecord, meta: dict[str, Any]) -> None:
    """A framework callback's report: its step, planned steps (the job's planned iterations,
    which SRTF reads) and last logged loss."""
    loss = meta.get("loss")
    if isinstance(loss, int | float):
        record.last_loss = float(loss)
    step = meta.get("step")
    core.event("progress", record.job_id, step=step if isinstance(step, int) else None,
               max_steps=meta.get("max_steps"), loss=record.last_loss)
    max_steps = meta.get("max_steps")
    if (isinstance(max_steps, int) and 0 < max_steps <= MAX_ITERATIONS
            and max_steps != record.planned_iterations):
        record.planned_iterations = max_steps
        if core.dispatch.job(record.job_id) is not None:
            core.dispatch.set_total(record.job_id, max_steps)


def restored(core: Core, record: JobRecord, restarts: int) -> None:
    """The daemon restarted while the job's command ran: its process is gone. With
    `--restart on-failure` and reruns left (it had `restarts`) the command runs again (its
    output to the job's log), a rerun counted as any other; else the job fails saying so."""
    why = (f"salusd restarted while job {record.job_id} ran its command "
           f"({_shown(record)}), whose process ended with it")
    if record.spec.get("restart") != "on-failure":
        core.end(record, "failed", why + "; run it with --restart on-failure (and keep its "
                 "checkpoints in salus.resume_dir()) to have it rerun")
        return
    command = ScriptCommand(tuple(record.spec["command"]), str(record.spec["cwd"]),
                            dict(record.spec.get("env", {})), "on-failure",
                            int(record.spec.get("max_restarts", MAX_RESTARTS)))
    record.script = ScriptState(command, restarts=restarts, last_failure=why)
    if restarts >= command.max_restarts:
        core.end(record, "failed", failed_reason(record, why))
        return
    record.script.restarts += 1
    core.event("restart", record.job_id, reason=why, restarts=record.script.restarts)
    start(core, record, command, None)


def _shown(record: JobRecord) -> str:
    """The command as a person would type it (its first 200 characters)."""
    text = " ".join([os.path.basename(record.spec["command"][0]),
                     *record.spec["command"][1:]])
    return text if len(text) <= 200 else text[:197] + "..."
