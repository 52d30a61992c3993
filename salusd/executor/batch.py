"""Batch jobs: the daemon drives the training loop itself from an entrypoint.

`POST /v1/jobs` names `file.py:function` under the daemon's `--job-root`. The executor, already
running as the job's owner, imports that file and calls the function, which returns the job in
the contract's terms::

    def make_job():
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def iteration(s, batch):
            ...; return loss
        return {"state": {"model": model, "opt": opt}, "iteration": iteration,
                "data": loader, "evaluate": evaluate, "every": 100}

`data` is any re-iterable (a list, a DataLoader): it is iterated again on exhaustion (epochs).
A pipeline job (submitted with ``"pipeline": true``) gives ``"loss": loss(output, target)`` and
may leave ``iteration`` out: the executor runs the pipeline step (`pipeline_job.py`).

Resuming from a checkpoint replays the data order exactly: the cursor records the global
random state at the start of the current epoch (a shuffling DataLoader draws its order from it)
and how many batches of the epoch were used; a restore re-creates that epoch's iterator under
the same random state and skips those batches. A data source with a generator of its own must
derive it from torch's global generator for that to hold (documented in docs/jobs.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

MAX_EVERY = 2**31


@dataclass
class BatchJob:
    """What an entrypoint returned, checked."""

    state: dict[str, Any]
    iteration: Callable[..., Any]
    data: Iterable[Any]
    evaluate: Callable[..., Any] | None = None
    every: int | None = None
    loss: Callable[..., Any] | None = None  # a pipeline job's loss(output, target)
    pipelined: bool = False  # the iteration is a pipeline step: whole batches, slowed per stage


def module_name(path: str) -> str:
    """A stable module name for the file at `path`, so objects pickled by reference to its
    classes in a checkpoint resolve again after a restart."""
    return "salus_job_" + hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:16]


def load_entrypoint(path: str, function: str) -> BatchJob:
    """Import `path` (as the job's owner: this runs in its executor) and call `function`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the entrypoint file {path} does not exist")
    name = module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = os.path.dirname(os.path.realpath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the job's own sibling modules import as in a script
    spec.loader.exec_module(module)
    make = getattr(module, function, None)
    if not callable(make):
        raise AttributeError(f"{path} has no function {function!r}")
    return check_job(make(), f"{os.path.basename(path)}:{function}")


def check_job(job: Any, where: str) -> BatchJob:
    if not isinstance(job, dict):
        raise TypeError(f"{where} must return a dict with 'state', 'iteration' and 'data', "
                        f"not a {type(job).__name__}")
    unknown = set(job) - {"state", "iteration", "data", "evaluate", "every", "loss"}
    if unknown:
        raise TypeError(f"{where} returned unknown keys {sorted(unknown)}")
    state, iteration, data = job.get("state"), job.get("iteration"), job.get("data")
    loss = job.get("loss")
    if not isinstance(state, dict) or not all(isinstance(k, str) and k.isidentifier()
                                              for k in state):
        raise TypeError(f"{where}: 'state' must be a dict of identifiers to objects")
    if loss is not None and not callable(loss):
        raise TypeError(f"{where}: 'loss' must be a function loss(output, target)")
    if iteration is None and loss is not None:
        iteration = _pipeline_only
    if not callable(iteration):
        raise TypeError(f"{where}: 'iteration' must be a function iteration(s, batch)")
    if not isinstance(data, Iterable) or isinstance(data, Iterator):
        raise TypeError(f"{where}: 'data' must be re-iterable (a list or a DataLoader), not a "
                        "one-shot iterator: it is iterated again each epoch")
    evaluate, every = job.get("evaluate"), job.get("every")
    if evaluate is not None and not callable(evaluate):
        raise TypeError(f"{where}: 'evaluate' must be a function evaluate(s)")
    if every is not None and (type(every) is not int or not 1 <= every <= MAX_EVERY):
        raise TypeError(f"{where}: 'every' must be an int from 1 to 2**31")
    if evaluate is not None and every is None:
        raise TypeError(f"{where}: 'evaluate' needs 'every' (run it every N iterations)")
    return BatchJob(state, iteration, data, evaluate, every, loss)


def _pipeline_only(s: Any, batch: Any) -> None:
    """The iteration of an entrypoint that gave 'loss' and no 'iteration'."""
    raise TypeError("the entrypoint gives 'loss' and no 'iteration': it runs only as a "
                    'pipeline job ("pipeline": true)')


class DataCursor:
    """Batches from `data`, epoch after epoch, with a position a checkpoint can restore."""

    def __init__(self, data: Iterable[Any]) -> None:
        self.data = data
        self.epoch = 0
        self.position = 0  # batches used of the current epoch
        self.epoch_rng: torch.Tensor | None = None
        self._it: Iterator[Any] | None = None
        self._peeked: list[Any] = []

    def peek(self) -> Any:
        """The next batch without using it (the admission estimate runs on it)."""
        if not self._peeked:
            self._peeked.append(self._next())
        return self._peeked[0]

    def next(self) -> Any:
        return self._peeked.pop() if self._peeked else self._next()

    def _next(self) -> Any:
        if self._it is None:
            self._start()
        assert self._it is not None
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch += 1
            self._start()
            try:
                batch = next(self._it)
            except StopIteration:
                raise ValueError("the job's data yielded no batch") from None
        self.position += 1
        return batch

    def _start(self) -> None:
        self.position = 0
        self.epoch_rng = torch.get_rng_state()
        self._it = iter(self.data)

    def state(self) -> dict[str, Any]:
        """Where the cursor stands: a batch peeked and not used is not counted."""
        return {"epoch": self.epoch, "position": self.position - len(self._peeked),
                "epoch_rng": self.epoch_rng}

    def restore(self, state: dict[str, Any]) -> None:
        """Stand where `state` says, with the same data order (see the module docstring)."""
        epoch_rng = state.get("epoch_rng")
        self._peeked.clear()
        if not isinstance(epoch_rng, torch.Tensor):
            self._it = None
            self.epoch = self.position = 0
            return
        now = torch.get_rng_state()
        torch.set_rng_state(epoch_rng)
        self._it = iter(self.data)
        self.epoch_rng = epoch_rng
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        for _ in range(self.position):
            next(self._it)
        if self.position == 0:
            # The epoch's first batch had been peeked, not used: it was fetched under the
            # epoch's random state (a sampler draws its order at the first `next`), so fetch it
            # the same way.
            self._peeked.append(next(self._it))
            self.position = 1
        torch.set_rng_state(now)


def scalar(value: Any) -> float | None:
    """A loss-like result as a float, when it is one number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().cpu())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None
