"""Lane workers: one thread per lane runs that lane's iterations one at a time.

Lanes run in parallel (torch releases the GIL inside its kernels). When a batch arrives for an
idle lane and the policy picks its job, the receiving thread runs that iteration itself under
the same lane claim (see `Daemon._take`); the worker runs everything that had to wait. At every
iteration boundary a
worker asks the daemon's `IterationScheduler` which job goes next, so suspend, resume, cancel
and priority changes act at the next boundary. On CUDA each lane has its own stream and
`torch.cuda.MemPool`, so lanes overlap on the device and their temporaries stay apart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from salus.daemon.core import Daemon

log = logging.getLogger("salusd.executor")


class LaneWorker(threading.Thread):
    """Runs the iterations of lane `lane_id` on daemon device `device` until the lane is freed."""

    def __init__(self, daemon: Daemon, device: int, lane_id: int) -> None:
        super().__init__(name=f"lane-{device}.{lane_id}", daemon=True)
        self.daemon_core = daemon
        self.device = device
        self.lane_id = lane_id
        self.stopping = False
        spec = daemon.devices[device]
        self.torch_device = torch.device(spec.torch_device)
        self.stream: torch.cuda.Stream | None = None
        self.pool: torch.cuda.MemPool | None = None
        if spec.kind == "cuda":
            self.stream = torch.cuda.Stream(self.torch_device)
            if hasattr(torch.cuda, "MemPool"):
                self.pool = torch.cuda.MemPool()

    @contextlib.contextmanager
    def on_lane(self) -> Iterator[None]:
        """Run the enclosed work on this lane's CUDA stream and memory pool (no-op on CPU)."""
        if self.stream is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.cuda.stream(self.stream))
            if self.pool is not None:
                stack.enter_context(torch.cuda.use_mem_pool(self.pool, self.torch_device))
            yield
        self.stream.synchronize()

    def run(self) -> None:
        core = self.daemon_core
        while True:
            work = core.next_work(self)
            if work is None:
                return
            core.run_work(self, *work)
