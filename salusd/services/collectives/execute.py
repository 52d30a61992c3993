"""Tree broadcast and allreduce over the daemon's devices, in place, like torch.distributed.

`tensors[i]` lives on device `plan.topology.devices()[i]`. The data is split across the plan's
trees by weight and chunked (see `schedule.Pipeline`); each step's transfers are issued in
order. On CPU devices every transfer is a real copy (or add) between the devices' buffers, done
one after another by the calling thread: the host has one memory system, so the pipeline order
is kept but links do not overlap. On CUDA devices copies are issued with `non_blocking=True` on
the devices' current streams, which PyTorch orders for cross-device copies; GPUs then overlap
the transfers of a step. With `async_op=True` the collective runs on a worker thread and a
`Work` handle comes back, as with torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .plan import TreePlan
from .schedule import Pipeline, Transfer

DEFAULT_CHUNK_BYTES = 1 << 20  # bytes per chunk of the heaviest tree


class Work:
    """Handle of an asynchronous collective: `wait()` blocks until it is done (re-raising its
    error); `is_completed()` polls."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or `timeout` seconds pass (TimeoutError); True when done."""
        self._future.result(timeout)
        return True

    def is_completed(self) -> bool:
        """True once the collective has finished (or failed)."""
        return self._future.done()


class SerialWorker:
    """Runs a module's asynchronous collectives one after another, in call order, on a thread
    of its own (named `thread_name`), started at the first one."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._pool: ThreadPoolExecutor | None = None

    def launch(self, run: Callable[[], None], async_op: bool) -> Work | None:
        """Call `run` now and return None; with `async_op`, queue it on the worker thread and
        return its `Work` handle."""
        if not async_op:
            run()
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        return Work(self._pool.submit(run))


_worker = SerialWorker("salus-collective")


def check_tensors(tensors: Sequence[torch.Tensor], plan: TreePlan) -> list[torch.Tensor]:
    """The tensors as a list, after checking they fit `plan` (ValueError/TypeError if not)."""
    if not isinstance(plan, TreePlan):
        raise TypeError(f"expected a TreePlan, got {type(plan).__name__}")
    out = list(tensors)
    n = len(plan.topology.devices())
    if len(out) != n:
        raise ValueError(f"the plan spans {n} devices but {len(out)} tensors were given")
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{i}] is not contiguous; pass t.contiguous()")
        if t.shape != out[0].shape or t.dtype != out[0].dtype:
            raise ValueError(f"tensors[{i}] is {tuple(t.shape)} {t.dtype}, tensors[0] is "
                             f"{tuple(out[0].shape)} {out[0].dtype}: all must match")
    return out


def run_transfers(flat: Sequence[torch.Tensor], step: Sequence[Transfer]) -> None:
    """Issue one pipeline step over flattened buffers `flat` (one per device position)."""
    for tr in step:
        src = flat[tr.src][tr.start:tr.stop]
        dst = flat[tr.dst][tr.start:tr.stop]
        if tr.reduce:
            dst.add_(src if src.device == dst.device else src.to(dst.device, non_blocking=True))
        else:
            dst.copy_(src, non_blocking=src.device != dst.device)


def _launch(steps: list[list[Transfer]], flat: list[torch.Tensor], async_op: bool) -> Work | None:
    def run() -> None:
        for step in steps:
            run_transfers(flat, step)

    return _worker.launch(run, async_op)


def _flat_pipeline(tensors: Sequence[torch.Tensor], plan: TreePlan,
                   chunk_bytes: int) -> tuple[list[torch.Tensor], Pipeline]:
    flat = [t.view(-1) for t in check_tensors(tensors, plan)]
    return flat, Pipeline(plan, flat[0].numel(), flat[0].element_size(), chunk_bytes)


def tree_broadcast(tensors: Sequence[torch.Tensor], plan: TreePlan, *,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, async_op: bool = False) -> Work | None:
    """Copy the root's tensor into every other tensor along the plan's trees, in place.

    `chunk_bytes`: pipeline chunk size in bytes for the heaviest tree. Returns None, or a
    `Work` handle with `async_op=True`."""
    flat, pipe = _flat_pipeline(tensors, plan, chunk_bytes)
    return _launch(pipe.broadcast_steps(), flat, async_op)


def tree_allreduce(tensors: Sequence[torch.Tensor], plan: TreePlan, *,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, async_op: bool = False) -> Work | None:
    """Sum all tensors into every tensor, in place: reduce toward the root along each tree,
    then broadcast back, pipelined by chunks of `chunk_bytes` bytes.

    Each reduce edge carries data child -> parent, so the topology needs links both ways (all
    presets have them). Returns None, or a `Work` handle with `async_op=True`."""
    flat, pipe = _flat_pipeline(tensors, plan, chunk_bytes)
    return _launch(pipe.allreduce_steps(), flat, async_op)
