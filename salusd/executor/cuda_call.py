"""What a call on a CUDA device adds around the job's function: its generator, its end, its peak.

- **Random state.** The job's CUDA generator state is set on its device before the call and
  read back after it, so jobs that share a process keep their own dropout streams.
- **GPU time.** Kernel launches are asynchronous: the call ends with a synchronisation of the
  job's device, so its `ended`, its seconds and the lane's next call measure and follow the GPU
  work, not the launches.
- **Peaks in reserved units, cache kept.** `set_per_process_memory_fraction` caps the caching
  allocator's reserved segments, not the bytes of live tensors. The cache is kept between calls
  and between the jobs of one process (emptying it synchronises the device and makes the next
  call allocate its whole working set again), so a call's peak is the larger of the bytes it
  allocated above the state, rounded up to the allocator's 2 MiB pages, and the segments the
  process reserved above the baseline during it (`peak`). The cache is emptied only when the
  job about to run may need more than the cap leaves free (`needs_room`).
- **Out of memory.** An out-of-memory error, torch's or another library's that allocates on
  the device (cuBLAS, NCCL, cupy: `cuda_errors.is_oom`), reports the peak the call had
  reached, at least the cap it hit, and frees the cached blocks it left behind.
- **Sticky errors.** An illegal address or a device-side assert poisons the process's context
  (`cuda_errors.is_sticky`): the call fails, and the executor ends after replying.

The executor holds one only while the job is on a CUDA device; on the CPU nothing of this runs.
"""

from __future__ import annotations

import contextlib

import torch

from salus.daemon.executor.cap import ProcessCap
from salus.daemon.executor.cuda_errors import is_oom

PAGE = 2 * 2**20  # the caching allocator's large-segment rounding (bytes)


class CudaCall:
    """The CUDA side of the job's calls on `device` (a CUDA device with its index), where the
    process may reserve `cap_bytes` (its `set_per_process_memory_fraction`)."""

    def __init__(self, device: torch.device, cap_bytes: int) -> None:
        self.device = device
        self.cap_bytes = cap_bytes
        self.baseline = 0  # bytes the process reserves with the job's state in place
        self.allocated = 0  # bytes allocated then (every job's state in this process)

    def hold(self) -> None:
        """Take the baseline: call once the state is in place (and again after it moves, or
        after another job's call)."""
        self.baseline = torch.cuda.memory_reserved(self.device)
        self.allocated = torch.cuda.memory_allocated(self.device)

    def persist(self) -> int:
        """The state grew during the first call (gradients, optimizer state): move the bytes
        it now holds into the baseline; returns them (bytes allocated)."""
        before = self.allocated
        self.hold()
        self.allocated = max(before, self.allocated)
        return self.allocated - before

    def begin(self, rng: torch.Tensor | None) -> None:
        """Before the call: the job's generator state `rng` (None: the device's as it is),
        and the peak's starting point."""
        if rng is not None:
            torch.cuda.set_rng_state(rng, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def finish(self) -> torch.Tensor:
        """After the call returned: wait for its kernels; returns the job's generator state."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.get_rng_state(self.device)

    def peak(self) -> int:
        """The call's peak above the state, in the allocator's units (bytes): what it
        allocated, in whole pages, or the segments it made the process reserve, the larger."""
        used = torch.cuda.max_memory_allocated(self.device) - self.allocated
        grown = torch.cuda.max_memory_reserved(self.device) - self.baseline
        return max(0, -(-used // PAGE) * PAGE, grown)

    def failed(self, exc: BaseException) -> tuple[torch.Tensor | None, int | None]:
        """After the call raised `exc`: (the job's generator state, None where it cannot be
        read; where `exc` is an out-of-memory error, the peak above the state (see
        `oom_peak`), else None)."""
        rng = None
        # A CUDA error that ended the call can fail these too; the call's own error is reported.
        with contextlib.suppress(RuntimeError):
            torch.cuda.synchronize(self.device)
            rng = torch.cuda.get_rng_state(self.device)
        if not is_oom(exc):
            return rng, None
        reached = torch.cuda.max_memory_reserved(self.device)
        torch.cuda.empty_cache()
        return rng, oom_peak(reached, self.cap_bytes, self.baseline)


def oom_peak(reached: int, cap_bytes: int, baseline: int) -> int:
    """The peak (bytes above `baseline`) to report for a call that ran out of memory after
    reserving `reached` bytes under a cap of `cap_bytes`: at least the cap, since the call
    needed more than the process could reserve (where others filled the device first, the
    cap overstates it; the call still needs more than `reached`)."""
    return max(0, max(reached, cap_bytes) - baseline)


def needs_room(reserved: int, need: int, cap_bytes: int) -> bool:
    """Whether the process must empty its cache before a job that may need `need` more bytes
    runs: it reserves `reserved` (state and cached blocks) and may reserve `cap_bytes`."""
    return reserved + need > cap_bytes


def make_room(cuda: CudaCall | None, lane_bytes: int, cap: ProcessCap) -> None:
    """The jobs of one process keep the caching allocator's blocks between their calls; empty
    the cache before a job runs only when what its lane may need (`lane_bytes`) exceeds what
    the cap leaves free beside what the process reserves (`needs_room`). `cuda`: the job's
    CUDA runtime (None: it runs on the CPU)."""
    if cuda is None:
        return
    reserved = torch.cuda.memory_reserved(cuda.device)
    if needs_room(reserved, lane_bytes, cap.bytes_on(str(cuda.device))):
        torch.cuda.empty_cache()


def seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    """The state of `device`'s generator once seeded with `seed` (as `torch.manual_seed(seed)`
    leaves every device's generator), without touching the device's own generator: jobs that
    share a process each start their stream there, not where the last job left it."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator.get_state()
