"""The REST API's request and response bodies (pydantic): what `/openapi.json` describes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from salus.daemon.limits import (
    DEFAULT_PRIORITY,
    MAX_AFTER,
    MAX_ARGS,
    MAX_DEVICES,
    MAX_GRACE_S,
    MAX_ITERATIONS,
    MAX_JOB_ID,
    MAX_MEM_BYTES,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_PRIORITY,
    MAX_RESTARTS,
    MAX_RESTARTS_LIMIT,
    MAX_TIME_LIMIT_S,
    as_value_error,
    check_iterations,
    check_name,
    check_priority,
)
from salus.scheduler.policies import POLICIES

# What /openapi.json says of the fields the shared checks (`salus.daemon.limits`) validate: the
# checks themselves run in the models' validators, so REST and the socket refuse alike.
_PRIORITY_SCHEMA: dict[str, Any] = {"type": "number", "exclusiveMinimum": 0,
                                    "exclusiveMaximum": MAX_PRIORITY}
_NAME_SCHEMA: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS}
_ITERATIONS_SCHEMA: dict[str, Any] = {"minimum": 1, "maximum": MAX_ITERATIONS}


class Strict(BaseModel):
    """A request body: no field but its own, every number finite and every string one UTF-8
    can encode. JSON carries NaN, Infinity and lone surrogates (`"\\ud800"`); no reply, log,
    database row or environment can."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _encodable(cls, value: Any) -> Any:
        if not _encodable(value):
            raise ValueError("must be text UTF-8 can encode: it holds a lone surrogate")
        return value


def _encodable(value: object) -> bool:
    """Whether every string in `value` (a str, or a list or dict of them, keys included) can be
    encoded as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list):
        return all(map(_encodable, value))
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    return True


class Health(BaseModel):
    status: Literal["ok"]


class Checkpoint(BaseModel):
    iteration: int
    time: float = Field(description="unix seconds")
    bytes: int
    path: str | None = None


class PipelineOut(BaseModel):
    placement: Literal["even", "sky", "optimal"]
    microbatches: int


class ExecutorOut(BaseModel):
    """The executor process a job runs in, the other jobs it hosts, and why."""

    pid: int | None
    shared_with: list[int]
    why: str


class JobOut(BaseModel):
    id: int
    name: str
    owner: str
    allocation: str | None = Field(default=None, description="a Kubernetes pod's job: the "
                                   "device plugin's allocation whose socket it came through")
    pod: str | None = Field(default=None, description="a Kubernetes pod's job: its pod, "
                            "\"namespace/name\", once the kubelet named it")
    kind: Literal["interactive", "batch", "script"]
    state: str
    reason: str
    exit_status: int | None = Field(default=None, description="a script job's command's exit "
                                    "status, as a shell reports it: 128 + N when signal N "
                                    "ended it, 125 when it could not start; null while it "
                                    "runs or when it never ran")
    signal: int | None = Field(default=None, description="the signal that ended a script "
                               "job's command (15: SIGTERM, 9: SIGKILL), else null")
    limit: Literal["time", "memory"] | None = Field(default=None, description="the limit that "
                                                    "ended the job: its --time or its --mem")
    ended_at: float | None = Field(default=None, description="when the job ended (unix "
                                   "seconds); null while it is live")
    iterations_done: int
    iterations_total: int
    device: int | None
    lane: int | None
    devices: int = 1  # replicas of a gang, one per device (device and lane: replica 0's)
    nodes: int = 1  # nodes the gang spans, `devices` replicas on each
    priority: float
    persistent_bytes: int
    ephemeral_bytes: int | None = Field(description="measured peak per call above the state, "
                                        "else the admission estimate")
    lane_bytes: int | None
    mem_bytes: int | None = Field(default=None, description="the device memory a script job "
                                  "asked for (--mem): its lane at admission and its cap")
    after: list[int] | None = Field(default=None, description="the jobs a script job runs "
                                    "after (--after)")
    waiting_for: list[int] = Field(default_factory=list, description="those of them that "
                                   "have not finished yet (the job is pending until then)")
    checkpoint: Checkpoint | None
    resumed_from: int | None
    swapped: bool = Field(default=False, description="its state was moved to host memory")
    entrypoint: str | None = None
    command: list[str] | None = Field(default=None, description="a script job's command")
    script: dict[str, Any] | None = Field(default=None, description="a script job's reruns "
                                          "(restart policy, restarts, max_restarts, the last "
                                          "failure) and what suspend --swap moved")
    last_loss: float | None = None
    last_evaluation: float | str | None = None
    cache: dict[str, Any] | None = Field(default=None, description="counters of the job's "
                                         "salus.data.CachedDataset reads (all replicas)")
    comm: dict[str, Any] | None = Field(default=None, description="a gang's collectives: "
                                        "bytes sent and calls by kind (all replicas), and the "
                                        "allreduce algorithm last used (what auto picked)")
    pipeline: PipelineOut | None = Field(default=None, description="a pipeline job's options")
    executor: ExecutorOut | None = Field(default=None, description="its executor process "
                                         "and the jobs that share it (one process per owner "
                                         "and lane), or why it has its own")


class JobSubmit(Strict):
    name: str = Field(json_schema_extra=_NAME_SCHEMA)
    entrypoint: str | None = Field(
        default=None, min_length=4, max_length=1024,
        pattern=r"^[^:\x00-\x1f\x7f]+\.py:[A-Za-z_]\w*$",
        description="a batch job: file.py:function, the file under the daemon's --job-root (no "
        "control characters)")
    command: list[str] | None = Field(
        default=None, min_length=2, max_length=MAX_ARGS,
        description="a script job instead: the interpreter and its arguments, [\"python\", "
        "\"train.py\", ...], run unchanged as the token's owner; its output is the job's log")
    cwd: str | None = Field(default=None, min_length=1, max_length=MAX_PATH_CHARS,
                            description="a script job's working directory (absolute)")
    env: dict[str, str] | None = Field(default=None, description="a script job's environment "
                                       "(default: HOME, USER, LOGNAME and the daemon's PATH)")
    restart: Literal["never", "on-failure"] = Field(
        default="never", description="a script job's policy when its command exits non-zero, "
        "its process dies or salusd restarts while it runs: fail it, or run its command again")
    max_restarts: int = Field(default=MAX_RESTARTS, ge=0, le=MAX_RESTARTS_LIMIT,
                              description="with restart on-failure, at most this many reruns")
    time_limit_s: float | None = Field(
        default=None, ge=0, le=MAX_TIME_LIMIT_S, description="a script job's time limit (seconds "
        "from its start, as Slurm's --time): then SIGTERM, SIGKILL after its grace, and the "
        "job fails saying it hit its time limit")
    signal: Literal[1, 2, 10, 12, 15] | None = Field(
        default=None, description="with time_limit_s: the signal number (HUP, INT, USR1, USR2, "
        "TERM) sent signal_before_s before the limit, as Slurm's --signal")
    signal_before_s: float | None = Field(default=None, ge=0, le=MAX_TIME_LIMIT_S)
    grace_s: float | None = Field(
        default=None, ge=0, le=MAX_GRACE_S, description="a script job's seconds between SIGTERM "
        "and SIGKILL when it is cancelled or hits its limit (default: the daemon's --script-grace)")
    mem_bytes: int | None = Field(default=None, ge=1, le=MAX_MEM_BYTES,
                                  description="a script job's device-memory request "
                                  "(bytes), as Slurm's --mem: its lane at admission and its cap")
    after: list[Annotated[int, Field(ge=1, le=MAX_JOB_ID)]] | None = Field(
        default=None, min_length=1, max_length=MAX_AFTER, description="a script job starts once "
        "these jobs have finished, and fails when one of them fails or is cancelled (Slurm's "
        "--dependency=afterok)")
    iterations: int | None = Field(default=None, json_schema_extra=_ITERATIONS_SCHEMA,
                                   description="required for a batch job; a script job's "
                                   "planned iterations (optimizer steps), for SRTF")
    priority: float = Field(default=DEFAULT_PRIORITY, json_schema_extra=_PRIORITY_SCHEMA)
    devices: int = Field(default=1, ge=1, le=MAX_DEVICES, description="replicas on this node, one "
                         "per device (a data-parallel gang when above 1); a torchrun "
                         "command's: its ranks (the default)")
    nodes: int = Field(default=1, ge=1, le=MAX_DEVICES, description="nodes of the cluster the gang "
                       "spans (submit it to each of them alike); needs salusd --cluster")
    rendezvous: str | None = Field(default=None, min_length=1, max_length=128,
                                   pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                   description="a multi-node gang's id, the same on every "
                                   "node and new for each submission (default: the name)")
    pipeline: bool = Field(default=False, description="split the entrypoint's model into one "
                           "stage per device and train it as a GPipe pipeline (docs/pipeline.md)")
    placement: Literal["even", "sky", "optimal"] | None = Field(
        default=None, description="a pipeline's split: even layer counts (default), the Sky "
        "Computing heuristic, or the MILP optimum, over a profile made by the replicas")
    microbatches: int | None = Field(default=None, ge=1, le=1024,
                                     description="micro-batches per pipeline step (default 1)")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return as_value_error(check_name, value)

    @field_validator("iterations")
    @classmethod
    def _iterations(cls, value: int | None) -> int | None:
        return None if value is None else as_value_error(check_iterations, value)

    @field_validator("priority")
    @classmethod
    def _priority(cls, value: float) -> float:
        return as_value_error(check_priority, value)

    @model_validator(mode="after")
    def _pipeline_options(self) -> JobSubmit:
        if (self.entrypoint is None) == (self.command is None):
            raise ValueError("give either 'entrypoint' (a batch job) or 'command' (a script "
                             "job)")
        if self.command is None and any(v is not None for v in (
                self.cwd, self.env, self.time_limit_s, self.signal, self.signal_before_s,
                self.grace_s, self.mem_bytes, self.after)):
            raise ValueError("'cwd', 'env', 'time_limit_s', 'signal', 'signal_before_s', "
                             "'grace_s', 'mem_bytes' and 'after' are a script job's: give "
                             "'command' too")
        if self.time_limit_s is None and (self.signal is not None
                                          or self.signal_before_s is not None):
            raise ValueError("'signal' and 'signal_before_s' go with 'time_limit_s'")
        if self.command is not None and self.cwd is None:
            raise ValueError("a script job needs 'cwd', the absolute directory it runs in")
        if self.entrypoint is not None and self.iterations is None:
            raise ValueError("a batch job needs 'iterations'")
        if self.command is not None and (self.pipeline or self.devices != 1 or self.nodes != 1):
            raise ValueError("a script job runs on one device: no pipeline, devices or nodes")
        if not self.pipeline and (self.placement is not None or self.microbatches is not None):
            raise ValueError("'placement' and 'microbatches' are options of pipeline jobs: "
                             "add \"pipeline\": true")
        return self

    def pipeline_options(self) -> dict[str, Any] | None:
        """What the engine gets: None for a job that is not a pipeline."""
        if not self.pipeline:
            return None
        return {"placement": self.placement or "even", "microbatches": self.microbatches or 1}


class Suspend(Strict):
    swap: bool = False


class Priority(Strict):
    priority: float = Field(json_schema_extra=_PRIORITY_SCHEMA)

    @field_validator("priority")
    @classmethod
    def _priority(cls, value: float) -> float:
        return as_value_error(check_priority, value)


class PolicyIn(Strict):
    policy: str = Field(description=f"one of {', '.join(POLICIES)}")

    @field_validator("policy")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy {value[:100]!r}; choose one of "
                             f"{', '.join(POLICIES)}")
        return value


class PolicyOut(BaseModel):
    policy: str
    pending: str | None = Field(description="switched to once the running iterations return")


class CheckpointDone(BaseModel):
    id: int
    checkpoint: Checkpoint


class LaneOut(BaseModel):
    device: int
    lane_id: int
    size_bytes: int
    jobs: list[int]
    busy_job: int | None


class DeviceOut(BaseModel):
    index: int
    torch_device: str
    compute_slowdown: float = Field(default=1.0, description="SIMULATED slowdown of this CPU "
                                    "device's computations (salusd --cpu-device-slowdown): its "
                                    "executors sleep (factor - 1) x each call's CPU time; "
                                    "1.0: none")
    capacity_bytes: int
    used_bytes: int
    persistent_bytes: int
    unreserved_bytes: int
    largest_free_bytes: int
    lanes: int
    jobs: int
    sharing: str = Field(default="", description="how its lanes' processes share it: in "
                         "parallel on the CPU, time-shared, or MPS (then whom the GPU's MPS "
                         "server serves and how many jobs of other owners wait)")


class TokenIn(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    user: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$",
                      description="the unix user the token's jobs run as")


class TokenOut(BaseModel):
    name: str
    owner: str
    uid: int
    created: float
    revoked_at: float | None


class TokenMade(TokenOut):
    token: str = Field(description="shown once; only its hash is stored")


class Problem(BaseModel):
    code: str
    detail: str


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "no token, or an unknown or revoked token"},
    403: {"model": Problem, "description": "the token's owner may not do this"},
    404: {"model": Problem, "description": "no such job"},
    409: {"model": Problem, "description": "the job's state does not allow this"},
}
