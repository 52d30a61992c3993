"""The job contract inside an executor: the job's shipped state, its functions, and one call.

A job is the user's named objects (modules, optimizers, LR schedulers, scalers, tensors, plain
objects) plus the user's own functions over them. The executor holds them in a `State`
namespace `s` and runs `fn(s, *args, **kwargs)` for each call. An exception in a call fails that
call only: the state stays as the exception left it, as in a loop that caught it.

Random numbers: the executor is the job's own process, so torch's generator is the job's own.
A call that carries the client's generator state sets it first; a reply carries the job's state
back whenever the call drew from it, so the client and the job share one stream. On a CUDA
device the job's CUDA generator state is kept with the job and set around each call
(`cuda_call.py`).
"""

from __future__ import annotations

import contextlib
import os
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from salus.daemon.executor import checkpoint, gang, unpickled
from salus.daemon.executor.batch import BatchJob, DataCursor, load_entrypoint, scalar
from salus.daemon.executor.cuda_call import CudaCall, seeded_state
from salus.daemon.executor.cuda_errors import is_sticky
from salus.daemon.executor.intact import snapshot, unchanged
from salus.daemon.executor.left_behind import device_bytes_left
from salus.daemon.executor.measure import (
    Footprint,
    estimate_call_peak,
    held_bytes,
    state_footprint,
)
from salus.daemon.executor.peak import PeakMeter
from salus.daemon.executor.results import (
    call_error,
    error_text,
    is_iteration,
    result_message,
    to_device,
    to_host,
)
from salus.daemon.executor.state_move import move_state
from salus.daemon.executor.visible import DEVICE_KIND_ENV
from salus.daemon.services import job_context as context
from salus.daemon.services.slowdown import ComputeSlowdown
from salus.daemon.wire import compact
from salus.daemon.wire.codec import Pickled, PickledPayload
from salus.daemon.wire.executor_ops import Attached, Checkpointed, GangPlace, Load, Loaded, StepDone
from salus.daemon.wire.frames import FUNCTION_MASK

if TYPE_CHECKING:  # a gang's replicas import it when they join (executor/gang.py)
    from salus.daemon.services.comm import Comm

MAX_FUNCTIONS = 1024


class State(types.SimpleNamespace):
    """The job's objects by the names the client attached them under (`s.model`, `s.opt`)."""


class JobRuntime:
    """One job's state and functions in this executor; every method answers one message."""

    def __init__(self) -> None:
        self.state = State()
        self.names: list[str] = []
        self.functions: dict[int, Callable[..., Any]] = {}
        self.kinds: dict[int, str] = {}  # function id -> "iteration" or "function"
        self.device = torch.device("cpu")
        self.meter = PeakMeter()  # peaks on a CPU device
        self.cuda: CudaCall | None = None  # the calls' CUDA side, while on a CUDA device
        self.cuda_rng: torch.Tensor | None = None  # the job's CUDA generator between calls
        self.seed = torch.initial_seed()  # the client's seed: its CUDA generator starts there
        self.last_span = (0.0, 0.0)
        self.last_oom: int | None = None  # the last call's peak when it ran out of memory
        self.poisoned: str | None = None  # a sticky CUDA error a call raised: the process ends
        self.retry = False  # the last call ran out of memory and left the state intact
        self._rewind: tuple[torch.Tensor, torch.Tensor | None] | None = None  # its rng before
        self._held = 0
        self._settled = False
        self.iterations = 0  # counted calls run: a checkpoint's iteration
        self.batch: BatchJob | None = None
        self.cursor: DataCursor | None = None
        self.gang: gang.GangSpec | None = None  # this replica's place in a gang job
        self.comm: Comm | None = None
        self._comm_state: Any = None  # a restored gang's comm state, until it joins
        self._broadcast_on_join = False  # a freshly loaded gang replica syncs once joined
        self.context = context.JobContext()  # the services a batch job's code can reach
        self.budget_bytes = 0  # persistent bytes plus the lane, where the daemon placed it
        self.slowdown = ComputeSlowdown()  # the device's simulated one (--cpu-device-slowdown)

    # ---- messages ---------------------------------------------------------------------------
    def attach(self, request: dict[str, Any], place: GangPlace | None = None) -> Attached:
        """Hold the client's objects; a replica of a gang job (`place`: its place in the gang)
        joins the gang's process group once it is placed (`place`), on its device's backend.
        Every replica loads the same bytes, so they start equal without a broadcast."""
        payload = request.get("objects")
        if not isinstance(payload, PickledPayload):
            raise TypeError("'attach' needs 'objects': the pickled named objects")
        self.gang = gang.GangSpec.of(place)
        objects = payload.load("attached objects", own=True)
        if not isinstance(objects, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                    for k in objects):
            raise TypeError("attached objects must be a dict of identifiers to objects")
        _set_rng(request)
        self.seed = torch.initial_seed()  # what the client's `torch.manual_seed` set
        self._hold(objects)
        state = state_footprint(objects.values())
        return Attached(state.bytes, torch.get_num_threads(),
                        persistent_reserved_bytes=state.reserved_bytes)

    def define(self, request: dict[str, Any]) -> None:
        fid, payload = request.get("fid"), request.get("fn")
        if type(fid) is not int or not 0 <= fid < MAX_FUNCTIONS:
            raise ValueError(f"function ids are 0..{MAX_FUNCTIONS - 1}, got {fid!r}")
        if not isinstance(payload, PickledPayload):
            raise TypeError("'define' needs 'fn': the pickled function")
        fn = payload.load("function")
        if not callable(fn):
            raise TypeError(f"a {type(fn).__name__} is not callable")
        self.functions[fid] = fn
        self.kinds[fid] = str(request.get("kind", "function"))

    def estimate(self, request: Any) -> tuple[Footprint, str]:
        """Peak ephemeral bytes of the call on fake copies of the state (exact and in reserved
        units); EstimationError when the call cannot run on fake tensors."""
        kwargs: dict[str, Any]
        if request is None and self.batch is not None and self.cursor is not None:
            fn, args, kwargs = self.batch.iteration, (self.cursor.peek(),), {}
        else:
            fn, args, kwargs = self._decode_call(request)
        rng = torch.get_rng_state()
        # On a GPU host the call is estimated on fake CUDA tensors (no CUDA starts for them;
        # `is_available` asks NVML, `PYTORCH_NVML_BASED_CUDA_CHECK`).
        gpu = os.environ.get(DEVICE_KIND_ENV) == "cuda" and torch.cuda.is_available()
        device = torch.device("cuda") if gpu else None
        try:
            return estimate_call_peak(fn, self.state, args, kwargs, device), "fake-tensor"
        finally:
            torch.set_rng_state(rng)  # the estimate must not consume the job's stream

    def run(self, request: Any) -> tuple[Any, float, int | None]:
        """Run one call: (reply message, seconds, peak bytes). The job's own exceptions become
        an error reply; the state stays, the random state too (the reply carries it back when
        the call drew before it failed, as a loop that caught the exception would go on)."""
        start = time.perf_counter()
        before: torch.Tensor | None = None
        self.last_oom, self.retry, self._rewind = None, False, None
        # On a GPU a call that runs out of memory may run again in a bigger lane (`intact.py`).
        state = snapshot(self._objects().values()) if self.cuda is not None else None
        cuda_rng = self.cuda_rng
        try:
            fn, args, kwargs = self._decode_call(request)
            if self.gang is not None:  # this replica's part of the client's arguments
                args, kwargs = gang.shard((args, kwargs), self.gang.rank, self.gang.world)
            before = torch.get_rng_state()
            result, peak = self._invoke(fn, args, kwargs)
            result = to_host(result)
        except BaseException as exc:  # noqa: BLE001 - SystemExit in job code fails the call
            reply = call_error(exc)
            if (self.last_oom is not None and state is not None and before is not None
                    and unchanged(state, self._objects().values())):
                self.retry = True  # it may run again, placed anew (`rewind`)
                self._rewind = (before, cuda_rng)
            after = torch.get_rng_state()
            if before is not None and not torch.equal(before, after):
                reply["rng"] = after
            return reply, time.perf_counter() - start, self.last_oom
        after = torch.get_rng_state()
        rng = None if torch.equal(before, after) else after
        return result_message(request, result, rng), time.perf_counter() - start, peak

    def rewind(self) -> None:
        """Before the last call runs again (`retry`): the random state as it found it."""
        assert self._rewind is not None
        cpu, self.cuda_rng = self._rewind
        torch.set_rng_state(cpu)
        self._rewind, self.retry = None, False

    def _invoke(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                slowed: bool = True) -> tuple[Any, int | None]:
        """`fn(s, *args, **kwargs)` on the job's device, with its peak measured, and slowed by
        the device's simulated slowdown unless `slowed` is False (a pipeline step slows each
        of its computations itself). On a CUDA device it ends when the GPU finished; when it
        runs out of device memory, `last_oom` is the peak it reached."""
        cuda = self.cuda
        if cuda is None:
            self.meter.start()
        else:
            cuda.begin(self.cuda_rng)
        try:
            args, kwargs = to_device((args, kwargs), self.device)
            began = time.monotonic()
            with self.slowdown if slowed else contextlib.nullcontext():
                result = fn(self.state, *args, **kwargs)
            if cuda is not None:
                self.cuda_rng = cuda.finish()
        except BaseException as exc:
            if cuda is not None:
                rng, self.last_oom = cuda.failed(exc)
                self.cuda_rng = self.cuda_rng if rng is None else rng
                if is_sticky(exc):
                    self.poisoned = error_text(exc)
            raise
        self.last_span = (began, time.monotonic())
        return result, self._settle(self.meter.peak() if cuda is None else cuda.peak())

    # ---- batch jobs and checkpoints -----------------------------------------------------------
    def load(self, request: Load) -> Loaded:
        """A batch job: import its entrypoint and hold what it returned; with `restore`, go on
        from the job's latest checkpoint (if it has one)."""
        # A gang's replica joins its group once placed (`place`: NCCL needs its device); what
        # the entrypoint builds over the gang (a salus.data.CachedDataset) is bound to it then.
        spec = self.gang = gang.GangSpec.of(request.gang)
        cache = request.cache
        self.context = context.JobContext(None, cache.dir if cache else None,
                                          cache.bytes if cache else None, gang=spec is not None)
        context.activate(self.context)
        job = load_entrypoint(request.path, request.function)
        self.seed = torch.initial_seed()  # its entrypoint's `torch.manual_seed`, if it called it
        if request.pipeline is not None:  # imported here: only these need scipy
            from salus.daemon.executor import pipeline_job

            job = pipeline_job.prepare(job, request.pipeline, spec, self)
        self.batch, self.cursor = job, DataCursor(job.data)
        self._hold(job.state)
        iteration = 0
        if request.restore:
            iteration = self.restore(request.dir, request.gang, request.at).iteration
        self._broadcast_on_join = spec is not None and not request.restore
        return self._loaded(iteration)

    def _loaded(self, iteration: int) -> Loaded:
        state = state_footprint(self._objects().values())
        return Loaded(state.bytes, iteration, persistent_reserved_bytes=state.reserved_bytes)

    def restore(self, where: str | None, place: GangPlace | None = None,
                at: int | None = None) -> Loaded:
        """Load the latest checkpoint under `where` (or the one of iteration `at`): objects,
        functions, random state, the iteration count and (batch jobs) where the data stood."""
        if self.batch is None:  # an interactive gang joins once placed (`place`)
            self.gang = gang.GangSpec.of(place) or self.gang
        loaded = checkpoint.load_latest(Path(str(where)), at)
        if loaded is None:
            if self.batch is not None:
                return self._loaded(0)
            raise FileNotFoundError(f"no checkpoint in {where}")
        payload = loaded.payload
        self._hold(payload["objects"])
        for fid, (kind, fn) in payload.get("functions", {}).items():
            self.functions[int(fid)], self.kinds[int(fid)] = fn, kind
        if self.cursor is not None and payload.get("cursor"):
            self.cursor.restore(payload["cursor"])
        if payload.get("comm"):  # sharded optimizer state, residuals
            if self.comm is not None:
                self.comm.restore_state(payload["comm"])
            else:
                self._comm_state = payload["comm"]
        torch.set_rng_state(payload["rng"]["cpu"])
        cuda_rng = payload["rng"].get("cuda")
        if isinstance(cuda_rng, torch.Tensor):
            self.cuda_rng = cuda_rng
        self.iterations = int(payload["iterations"])
        return self._loaded(self.iterations)

    def checkpoint(self, where: str | None, job: int) -> Checkpointed:
        """Write the job's persistent state at this boundary (see `checkpoint.py`)."""
        payload = {
            "objects": self._objects(),
            "functions": ({} if self.batch is not None else
                          {fid: (self.kinds[fid], fn) for fid, fn in self.functions.items()}),
            "rng": {"cpu": torch.get_rng_state(), "cuda": self.cuda_rng},
            "iterations": self.iterations,
            "cursor": self.cursor.state() if self.cursor is not None else None,
            "comm": self.comm.checkpoint_state() if self.comm is not None else None,
        }
        saved = checkpoint.save(Path(str(where)), self.iterations, payload,
                                extra={"job": job, "kind": (
                                    "batch" if self.batch else "interactive")})
        return Checkpointed(saved.iteration, saved.bytes, saved.seconds, str(saved.path),
                            time.time())

    def step(self) -> StepDone:
        """One iteration of a batch job on its next batch; an exception fails the job, as it
        would end the script."""
        assert self.batch is not None and self.cursor is not None
        start = time.perf_counter()
        loss: float | None = None
        evaluation: float | str | None = None
        message: str | None = None
        trace: str | None = None
        cache: dict[str, Any] | None = None
        comm: dict[str, Any] | None = None
        self.last_oom = None
        try:
            batch = self.cursor.next()
            if self.gang is not None and not self.batch.pipelined and not getattr(
                    self.batch.data, "per_replica", False):  # a ReplicaLoader reads its part
                batch = gang.shard(batch, self.gang.rank, self.gang.world)
            result, peak = self._invoke(self.batch.iteration, (batch,), {},
                                        slowed=not self.batch.pipelined)
            self.iterations += 1
            ok, loss = True, scalar(result)
            cache, comm = self.service_counters()
            every = self.batch.every
            if self.batch.evaluate is not None and every and self.iterations % every == 0:
                value = self.batch.evaluate(self.state)
                evaluation = scalar(value) if scalar(value) is not None else str(value)[:200]
        except BaseException as exc:  # noqa: BLE001 - SystemExit in job code fails the job
            ok, peak, message = False, self.last_oom, error_text(exc)
            trace = call_error(exc)["traceback"]
        began, ended = self.last_span
        return StepDone(ok, time.perf_counter() - start, peak, is_iteration(None, self.kinds),
                        began, ended, self.iterations, loss, evaluation, message, trace, cache,
                        comm, oom=self.last_oom is not None)

    def _join_placed(self) -> None:
        """A gang's replica, just placed, joins its process group on its device's backend
        (NCCL on CUDA), then takes a restored comm state; a batch job's data sets take the
        Comm, and a freshly loaded one's replicas start from replica 0's state."""
        assert self.gang is not None
        self.comm = gang.join(self.gang, self.device)
        self.state.comm = self.comm
        self.context.joined(self.comm)
        if self._comm_state is not None:
            self.comm.restore_state(self._comm_state)
            self._comm_state = None
        if self._broadcast_on_join:
            self._broadcast_on_join = False
            gang.broadcast_state(self.comm, self._objects())

    def service_counters(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """What the job's services counted so far, for a call's reply: its data sets' cache
        counters and what `s.comm` sent and which algorithm "auto" picked last; each None
        where the job does not use it."""
        comm = self.comm.stats.snapshot() if self.comm is not None else None
        return self.context.cache_stats(), comm

    def _objects(self) -> dict[str, Any]:
        """The job's named objects (``s.comm``, a service, is not one of them)."""
        return {name: getattr(self.state, name) for name in self.names}

    def _hold(self, objects: dict[str, Any]) -> None:
        unpickled.rebuild(objects.values())
        self.state = State(**objects)
        self.names = list(objects)
        if self.comm is not None:
            self.state.comm = self.comm
        self.take_baseline()
        self._held = held_bytes(objects.values())
        self._settled = False

    def _settle(self, peak: int | None) -> int | None:
        """The first call creates state lazily (gradients, optimizer state): persistent bytes,
        booked apart, so they leave the call's peak and join the baseline."""
        if self._settled or peak is None:
            return peak
        self._settled = True
        if self.cuda is not None:
            grown = self.cuda.persist()
        else:
            grown = max(0, held_bytes(self._objects().values()) - self._held)
            self.meter.baseline += grown
        return max(0, peak - grown)

    def take_baseline(self) -> None:
        """Take the peak's baseline, with the state in place on its device."""
        if self.cuda is not None:
            self.cuda.hold()
        else:
            self.meter.set_baseline()

    def pull(self, request: dict[str, Any]) -> Any:
        """The named objects' state (`result`: a `state_dict()` where they have one) and, for
        modules, what their state_dict leaves out (`modules`: each submodule's train/eval
        flag in `modules()` order and the non-persistent buffers by name)."""
        names = request.get("names") or self.names
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise KeyError(f"the job has no objects named {unknown}; it has {self.names}")
        out = {}
        modules = {}
        for name in names:
            obj = getattr(self.state, name)
            if isinstance(obj, torch.Tensor):
                out[name] = obj.detach().to("cpu", copy=True)
            elif callable(getattr(obj, "state_dict", None)) and not isinstance(obj, type):
                out[name] = to_host(obj.state_dict())
            else:
                out[name] = obj
            if isinstance(obj, nn.Module):
                kept = out[name]
                modules[name] = {"training": [m.training for m in obj.modules()],
                                 "buffers": {k: to_host(b) for k, b in obj.named_buffers()
                                             if k not in kept}}
        return {"ok": True, "result": Pickled(out, "the job's state"),
                "modules": Pickled(modules, "the job's modules' modes")}

    def place(self, device: str, budget_bytes: int, slowdown: float = 1.0) -> None:
        """Move the state to `device`, where the job may hold `budget_bytes` (its persistent
        bytes plus its lane; the process's cap, which covers every job placed in it, is set
        before: `cap.py`); the job's calls are slowed by the device's simulated `slowdown`
        factor from now on."""
        target = torch.device(device)
        self.budget_bytes, self.slowdown.factor = budget_bytes, slowdown
        cuda = None
        if target.type == "cuda":
            if target.index is None:
                target = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(target)
            total = torch.cuda.get_device_properties(target).total_memory
            cuda = CudaCall(target, min(budget_bytes, total))
            if self.cuda_rng is None:  # as the client's `torch.manual_seed` seeds its GPUs
                self.cuda_rng = seeded_state(target, self.seed)
        if target != self.device:
            self._move(target)
        self.cuda = cuda
        if self.gang is not None and self.comm is None:
            self._join_placed()
        self.take_baseline()

    def swap_out(self, others: Iterable[object] = ()) -> dict[str, int | str | None]:
        """Move the state to host memory (a no-op for a CPU device, whose budget the daemon
        has already released); from a CUDA device through pinned buffers (`transfer.py`).
        Returns what the `Swapped` reply carries: `device_bytes_left`, the bytes still
        allocated on the device after the move less what `others` (the objects of the
        process's other jobs) hold there (`left_behind.py`); 0 on a CPU device."""
        left = 0
        if self.device.type != "cpu":
            device = self.device
            self._move(torch.device("cpu"))
            self.cuda = None
            torch.cuda.empty_cache()
            left = device_bytes_left(device, others)
        return {"device_bytes_left": left}

    def handover_state(self) -> dict[str, Any]:
        """What another executor of the owner needs to take the job over (`take_over`): its
        objects (moved to host memory first), functions, iteration count and CUDA generator.
        ValueError for a job bound to this process (a gang replica, a batch job)."""
        if self.gang is not None or self.batch is not None or self.comm is not None:
            raise ValueError("a gang replica or a batch job stays in its own executor")
        if self.device.type != "cpu":
            self._move(torch.device("cpu"))
            self.cuda = None
        return {"objects": self._objects(), "functions": self.functions, "kinds": self.kinds,
                "iterations": self.iterations, "cuda_rng": self.cuda_rng,
                "seed": self.seed, "settled": self._settled}

    def take_over(self, state: dict[str, Any]) -> None:
        """Hold a job handed over by another executor (`handover_state`), on the host until
        its `place`."""
        self._hold(state["objects"])
        self.functions, self.kinds = state["functions"], state["kinds"]
        self.iterations, self.cuda_rng = state["iterations"], state["cuda_rng"]
        self.seed = state["seed"]
        self._settled = state["settled"]

    # ---- internals --------------------------------------------------------------------------
    def _move(self, device: torch.device) -> None:
        """Every tensor of the job's objects to `device`, in place (`state_move.py`)."""
        move_state(self._objects().values(), device)
        self.device = device

    def _decode_call(self, request: Any) -> tuple[Callable[..., Any], tuple[Any, ...],
                                                  dict[str, Any]]:
        if type(request) is compact.Message:
            tensors = request.tensors
            if request.aux & compact.AUX_RNG:
                torch.set_rng_state(tensors[-1])
                tensors = tensors[:-1]
            return self._function(request.aux & FUNCTION_MASK), tensors, {}
        _set_rng(request)
        payload = request.get("args")
        args, kwargs = payload.load("call arguments") if isinstance(
            payload, PickledPayload) else ((), {})
        inline = request.get("fn")
        fn = (inline.load("function") if isinstance(inline, PickledPayload)
              else self._function(request.get("fid")))
        return fn, tuple(args), dict(kwargs)

    def _function(self, fid: object) -> Callable[..., Any]:
        fn = self.functions.get(fid) if type(fid) is int else None
        if fn is None:
            raise LookupError(f"the job has no function {fid!r}; define it first")
        return fn


def _set_rng(request: dict[str, Any]) -> None:
    rng = request.get("rng")
    if isinstance(rng, torch.Tensor):
        torch.set_rng_state(rng)
