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
process cannot outlive the daemon: when salusd stops it sends the command SIGTERM and waits for it
up to `script_grace_s` (its handler may save a checkpoint and exit), then kills it; after the
restart the job is reported failed, saying so, or with `on-failure` its command runs again
(output to the job's log); its checkpoints are its own, in `salus.resume_dir()`.

A torchrun command (`python -m torch.distributed.run --nproc-per-node N train.py`,
`torchrun.py`) is a gang script job: one executor per rank, each on its own device, runs
`python train.py` with the rank's variables (`RANK`, `WORLD_SIZE`, `MASTER_PORT`...), and its
own client socket (`salusd run` sends one per rank). The gang's iterations are scheduled as one
(the dispatcher's gang rule): each rank's boundary asks for a turn, and the gang's next
iteration is asked for once every rank still running is at its boundary; it then runs on every
rank at once. There is no lease: every boundary goes through the daemon, as every call of an
interactive gang does. A rank that exits 0 waits for the others; the job finishes when every
rank has. The first rank that exits non-zero, or whose executor dies, fails the job with its
reason (`rank 1: ...`); its peers, who may wait for it in a collective, get SIGTERM and are
killed after the grace, as torchrun's agent stops a failed gang. A gang is not rerun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Any

from salus.daemon.devices.discovery import pinned_gpus
from salus.daemon.engine import torchrun
from salus.daemon.engine.core import Core, exit_detail
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.engine.lifecycle import Phase
from salus.daemon.engine.ports import OnDone
from salus.daemon.engine.registry import JobRecord, requested_memory
from salus.daemon.engine.script_command import ScriptCommand, with_array, with_grace, with_limits
from salus.daemon.engine.script_state import ScriptState
from salus.daemon.limits import (
    MAX_ITERATIONS,
    MAX_RESTARTS,
)
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import RESTARTING, Progress, Reply, Script, failure, succeeded
from salus.daemon.wire.frames import FLAG_SOCKET, RawFrame, json_frame

log = logging.getLogger("salusd.engine")
JOB_ID_ENV, JOB_NAME_ENV = "SALUS_JOB_ID", "SALUS_JOB_NAME"  # as Slurm's SLURM_JOB_ID, _NAME
CANNOT_START = 125  # a command that could not start, as env(1) and container runners say
# A job array's task: its index and the array's job id, as Slurm's SLURM_ARRAY_TASK_ID and
# SLURM_ARRAY_JOB_ID.
ARRAY_INDEX_ENV, ARRAY_JOB_ENV = "SALUS_ARRAY_INDEX", "SALUS_ARRAY_JOB_ID"


def pinned_devices(core: Core, command: ScriptCommand) -> frozenset[int] | None:
    """The devices a script whose caller set `CUDA_VISIBLE_DEVICES` may be placed on: the GPUs
    that pin names (`devices.pinned_gpus`), so admission honours it; None where it set none or
    this node has no GPU (a CPU device is only a budget). BadRequest when the pin names
    fewer GPUs of this node than the job has ranks."""
    pin = command.env.get("CUDA_VISIBLE_DEVICES")
    gpus = core.config.gpu_uuids
    if pin is None or not gpus or not all(gpus):
        return None
    named = pinned_gpus(pin, gpus)
    if len(named) < command.ranks:
        served = ", ".join(gpus)
        raise BadRequest(f"the script's CUDA_VISIBLE_DEVICES={pin!r} names "
                         f"{len(named) or 'no'} GPU(s) of this node and the job needs "
                         f"{command.ranks}; salusd places it on a GPU the pin names and shows "
                         f"it only that one: name GPUs this node has ({served}, by index, UUID "
                         "or UUID prefix) or unset CUDA_VISIBLE_DEVICES")
    return frozenset(named)


def spec(command: ScriptCommand) -> JobSpec:
    """What the durable registry keeps of the job: the environment only where the job may be
    rerun after a restart (`on-failure`), which needs it; a gang's ranks as its devices."""
    limited = command.time_limit_s is not None
    return JobSpec(
        devices=command.ranks, command=command.command, cwd=command.cwd,
        env=command.env if command.restart == "on-failure" else None,
        restart=command.restart, max_restarts=command.max_restarts, grace_s=command.grace_s,
        mem_bytes=command.mem_bytes, time_limit_s=command.time_limit_s,
        signal=command.signal if limited else None,
        signal_before_s=command.signal_before_s if limited else None,
        array_index=command.array_index, array_job=command.array_job)


def start(core: Core, record: JobRecord, command: ScriptCommand,
          frames: Sequence[RawFrame] | None,
          after: Callable[[Callable[[], None]], None], here: RawFrame | None = None) -> None:
    """Give the job an executor per rank and start its command there; `frames` carry the
    client's sockets, one per rank (None: no client, the output goes to the job's log).
    Its time limit is armed when its command first runs (rank 0's started), so it counts
    the command's time, not the wait for an executor; reruns share it (`arm_limits`;
    `after` runs a timer's work and steps the engine). `here`: the caller's own process is
    the executor, on the link this frame's descriptor is (the executor port adopts it)."""
    state = record.script
    if state is None:
        state = record.script = ScriptState(command)
        fd = frames[0].fd if frames else None
        if fd is not None and command.restart == "on-failure":
            state.client_fd = os.dup(fd)
    if here is not None:
        state.here, here.fd = here.fd, None
    in_pod = state.here is not None
    core.outbox.acquire(record, command.ranks)
    # The caller's process may not see the state dir (a pod): no resume directory there.
    resume = (None if record.checkpoint.dir is None or in_pod
              else os.path.join(record.checkpoint.dir, "resume"))

    def started(rank: int) -> OnDone:
        def done(reply: Reply) -> None:
            if not record.live:
                return
            if succeeded(reply):
                # Its boundaries come from its executor, as direct calls; a gang's through the
                # daemon (its ranks' turns are one).
                record.direct = record.gang == 1
                if record.life.phase is Phase.OPEN:
                    record.life.attached()
                if rank == 0 and not state.limits_armed:
                    state.limits_armed = True
                    arm_limits(core, record, command, after)
            else:
                who = f"rank {rank}: " if record.gang > 1 else ""
                record.exit_status = CANNOT_START
                core.end(record, "failed", f"the script could not start: {who}"
                         f"{failure(reply)[:2000]}")
        return done

    # The job's id and name in its environment, as Slurm's SLURM_JOB_ID and SLURM_JOB_NAME.
    env = {**command.env, JOB_ID_ENV: str(record.job_id), JOB_NAME_ENV: record.name}
    if command.array_index is not None:
        env.update({ARRAY_INDEX_ENV: str(command.array_index),
                    ARRAY_JOB_ENV: str(command.array_job or record.job_id)})
    launch = command.launch
    port = _store_port(launch) if launch is not None else 0
    for rank, executor in enumerate(record.replicas):
        argv, ranked = command.command[1:], env
        if launch is not None:
            argv, ranked = launch.argv, {**env, **launch.rank_env(rank, port, command.env)}
        script = Script(command.command[0], argv, ranked, resume,
                        None if frames is not None else False, state.restarts)
        core.outbox.send_to(executor, script, frames[rank] if frames is not None else None,
                            on_done=started(rank))


def _store_port(launch: torchrun.Launch) -> int:
    """The port of the gang's store (`MASTER_PORT`): the one given, else one free now on its
    address (as torchrun's agent picks one)."""
    if launch.master_port is not None:
        return launch.master_port
    with socket.socket() as sock:
        try:
            sock.bind((launch.master_addr, 0))
        except OSError:  # an address of another host: rank 0 listens on every address here
            sock.bind(("", 0))
        return int(sock.getsockname()[1])


def exited(core: Core, record: JobRecord, code: int, rank: int = 0) -> None:
    """The job's command exited with status `code` (a gang's, on `rank`): the job ends, or
    with `on-failure` and reruns left a non-zero status lets its executor go, and the command
    runs again once it is gone (`executor_gone`)."""
    if record.gang > 1:
        _rank_exited(core, record, rank, code)
        return
    record.exit_status, record.signal = code, None
    if not record.live:  # cancelled: its command ended within its grace
        record.life.grace_over()
        core.event("exit", record.job_id, **exit_detail(record))
        core.finalize(record)
        return
    if core.stopping:  # on salusd's SIGTERM: the job stays, restored (or rerun) at the next start
        log.info("job %d's command exited with status %d as salusd stops", record.job_id, code)
        core.outbox.retire_all(record, "shutting_down", "salusd is shutting down")
        return
    why = f"its command exited with status {code}: {_shown(record)}"
    if code != 0 and may_rerun(core, record):
        assert record.script is not None
        record.script.restarting = why
        record.direct = False  # no lease for the run that ended
        core.outbox.retire_all(record, RESTARTING, why)
        return
    core.end(record, "finished" if code == 0 else "failed", failed_reason(record, why))


def _rank_exited(core: Core, record: JobRecord, rank: int, code: int) -> None:
    """Rank `rank` of a gang exited with `code`: the first failure fails the gang (its
    peers get SIGTERM and the grace, `Core.end`), the last success finishes it, and a rank
    done before its peers waits for them (its executor keeps its status for its client)."""
    state = record.script
    assert state is not None
    state.exits[rank] = code
    state.ready.discard(rank)
    if record.live:  # the gang's status: its first failed rank's, else 0
        record.exit_status, record.signal = code, None
    if not record.live:  # ended meanwhile: its client hears the status now
        core.outbox.retire(record.replicas[rank], "job_failed" if record.life.end_state == "failed"
                           else "job_cancelled", f"job {record.job_id} has {record.life.end_state}")
        settle_grace(core, record)
        return
    if code != 0:
        core.end(record, "failed", f"rank {rank}: its command exited with status {code}: "
                 f"{_shown(record)}", grace=True)
    elif len(state.exits) == record.gang:
        core.end(record, "finished", f"its command exited with status 0 on all "
                 f"{record.gang} ranks: {_shown(record)}")


def settle_grace(core: Core, record: JobRecord) -> None:
    """An ended gang's grace is over once none of its ranks runs its command any more (each
    exited, or its executor is gone)."""
    state = record.script
    if state is not None and all(rank in state.exits or not core.outbox.alive(executor)
                                 for rank, executor in enumerate(record.replicas)):
        record.life.grace_over()


def rank_ready(record: JobRecord, rank: int) -> bool:
    """Rank `rank` of a gang is at a boundary, waiting for its turn: True once every rank
    still running is (the gang's next iteration is then asked for, once)."""
    state = record.script
    assert state is not None
    state.ready.add(rank)
    return turn_due(record)


def turn_due(record: JobRecord) -> bool:
    """Whether every rank of the gang still running waits at a boundary (then they are no
    longer counted as waiting: their turn is asked for)."""
    state = record.script
    if state is None:
        return False
    waiting = set(range(record.gang)) - state.exits.keys()
    if not waiting or not waiting <= state.ready:
        return False
    state.ready.clear()
    return True


def stop_all(core: Core) -> int:
    """salusd is stopping: SIGTERM to every live script job's command (as `end` does for one
    job); the number of jobs signalled."""
    signalled = 0
    for record in core.registry:
        if record.live and not record.life.grace and _command_runs(core, record):
            signal_running(core, record, signal.SIGTERM)
            signalled += 1
    return signalled


def arm_limits(core: Core, record: JobRecord, command: ScriptCommand,
               after: Callable[[Callable[[], None]], None]) -> None:
    """Slurm's `--time` and `--signal` for a script job, from now (its command started): its
    `signal` that long before its time limit, to each of its processes still running its
    command, and at the limit the job ends failed, its command given SIGTERM and the grace
    (`Core.end`). `after` runs a timer's work and steps the engine."""
    limit = command.time_limit_s
    if limit is None:
        return
    if command.signal is not None:
        signum = command.signal

        def warn() -> None:
            if record.live and record.script is not None:
                signal_running(core, record, signum)

        core.timers.call_later(max(0.0, limit - command.signal_before_s), warn)

    def time_up() -> None:
        if record.live:
            record.limit = "time"
            core.end(record, "failed", f"job {record.job_id} hit its time limit of "
                     f"{limit:g} s", grace=True)

    core.timers.call_later(limit, lambda: after(time_up))


def signal_running(core: Core, record: JobRecord, signum: int) -> None:
    """`signum` to each of the script job's processes (a gang's ranks) still running its
    command; a gang's rank that exited drains, and a signal would run its handler again."""
    assert record.script is not None
    for rank, executor in enumerate(record.replicas):
        if rank not in record.script.exits:
            core.outbox.signal(executor, signum)


def running(core: Core) -> bool:
    """Whether a live script job's command still runs (shutdown waits for these)."""
    return any(_command_runs(core, record) for record in core.registry)


def _command_runs(core: Core, record: JobRecord) -> bool:
    return record.script is not None and any(
        core.outbox.alive(executor) for executor in record.replicas)


def died(record: JobRecord, exit_code: int | None) -> None:
    """The script job's executor process, which runs its command, ended with `exit_code`
    (-N: signal N; None: unknown) without the command's status: recorded as a shell reports
    it (128 + N for signal N), and a command whose executor went before it started as one
    that could not start. Not for a job that ended otherwise, nor a run already over (its
    command's own status stands)."""
    state = record.script
    if state is None or state.restarting or not (record.live or record.life.grace):
        return
    if record.gang > 1 and not record.live:  # a gang's status is its first failed rank's
        return
    if exit_code is not None:
        record.signal = -exit_code if exit_code < 0 else None
        record.exit_status = 128 - exit_code if exit_code < 0 else exit_code
    elif not record.direct:
        record.exit_status = CANNOT_START
    record.life.grace_over()  # its command is over


def may_rerun(core: Core, record: JobRecord) -> bool:
    """Whether the live job's command runs again after a failure (`on-failure`, reruns left,
    not being cancelled, salusd not stopping)."""
    state = record.script
    return (state is not None and record.live and not core.stopping
            and not record.life.cancel_requested and state.command.restart == "on-failure"
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


def rerun(core: Core, record: JobRecord, after: Callable[[Callable[[], None]], None]) -> None:
    """Run the job's command again in a fresh executor, in its resume directory, its client
    (if it is still there) attached again. `after`: as `start`'s."""
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
    start(core, record, state.command, None if frame is None else [frame], after)


def view(record: JobRecord) -> dict[str, Any] | None:
    """What status and info show of a script job (None for any other job)."""
    state = record.script
    if state is None:
        return None
    array = state.command.array_index
    return {"restart": state.command.restart, "restarts": state.restarts,
            "array": None if array is None else {"job": state.command.array_job
                                                 or record.job_id, "index": array},
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


def progress(core: Core, record: JobRecord, report: Progress) -> None:
    """A framework callback's report: its step, planned steps (the job's planned iterations,
    which SRTF reads) and last logged loss."""
    if report.loss is not None:
        record.progress.last_loss = report.loss
    core.event("progress", record.job_id, step=report.step, max_steps=report.max_steps,
               loss=record.progress.last_loss)
    max_steps = report.max_steps
    if (max_steps is not None and 0 < max_steps <= MAX_ITERATIONS
            and max_steps != record.planned_iterations):
        record.planned_iterations = max_steps
        if core.dispatch.job(record.job_id) is not None:
            core.dispatch.set_total(record.job_id, max_steps)


def restored(core: Core, record: JobRecord, restarts: int,
             after: Callable[[Callable[[], None]], None]) -> None:
    """The daemon restarted while the job's command ran: its process is gone. With
    `--restart on-failure` and reruns left (it had `restarts`) the command runs again (its
    output to the job's log), a rerun counted as any other, with its whole time limit again
    (the clock of the run before went with the daemon); else the job fails saying so."""
    why = (f"salusd restarted while job {record.job_id} ran its command "
           f"({_shown(record)}), whose process ended with it")
    if record.spec.restart != "on-failure":
        core.end(record, "failed", why + "; run it with --restart on-failure (and keep its "
                 "checkpoints in salus.resume_dir()) to have it rerun")
        return
    command = stored(record)
    record.script = ScriptState(command, restarts=restarts, last_failure=why)
    if restarts >= command.max_restarts:
        core.end(record, "failed", failed_reason(record, why))
        return
    record.script.restarts += 1
    core.event("restart", record.job_id, reason=why, restarts=record.script.restarts)
    start(core, record, command, None, after)


def stored(record: JobRecord) -> ScriptCommand:
    """The command the durable registry kept of the job (`spec`)."""
    spec = record.spec
    assert spec.cwd is not None, "a script job's spec names its directory"
    command = ScriptCommand(spec.command, spec.cwd, dict(spec.env or {}), spec.restart,
                            MAX_RESTARTS if spec.max_restarts is None else spec.max_restarts,
                            mem_bytes=requested_memory(record))
    command = with_array(command, spec.array_index, spec.array_job)
    command = with_grace(command, spec.grace_s)
    return with_limits(command, spec.time_limit_s, spec.signal, spec.signal_before_s)


def _shown(record: JobRecord) -> str:
    """The command as a person would type it (its first 200 characters)."""
    text = " ".join([os.path.basename(record.spec.command[0]), *record.spec.command[1:]])
    return text if len(text) <= 200 else text[:197] + "..."
