"""Which errors a call on a CUDA device raised: out of memory, or a poisoned context.

- **Out of memory** (`is_oom`): torch's `OutOfMemoryError`, and the same condition reported by
  the other libraries that allocate device memory in a job: cuBLAS/cuDNN (`*_STATUS_ALLOC_FAILED`),
  the CUDA runtime (`cudaErrorMemoryAllocation`, "out of memory", as NCCL and cupy report it) and
  cupy's own `OutOfMemoryError`. The daemon treats them alike: the job needs a bigger lane.
- **Sticky errors** (`is_sticky`): an illegal address, a device-side assert, a misaligned
  address, an illegal instruction or a launch failure leave the CUDA context unusable for every
  later call of the process (CUDA's programming guide: such errors are "sticky" and the process
  must end); torch raises them as `torch.AcceleratorError` (older releases: `RuntimeError` with
  the CUDA error's text). The executor replies with the error and ends.
"""

from __future__ import annotations

import re

import torch

_OOM = re.compile(r"out of memory|ALLOC_FAILED|cudaErrorMemoryAllocation|"
                  r"CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)
_STICKY = re.compile(
    r"illegal memory access|illegal address|device-side assert|misaligned address|"
    r"illegal instruction|unspecified launch failure|invalid program counter|"
    r"launch timed out|uncorrectable ECC|cudaErrorIllegal|cudaErrorAssert|"
    r"cudaErrorMisaligned|cudaErrorLaunchFailure|CUDA_ERROR_ILLEGAL|CUDA_ERROR_ASSERT|"
    r"CUDA_ERROR_LAUNCH_FAILED|CUDA_ERROR_MISALIGNED", re.IGNORECASE)
_ACCELERATOR_ERROR: type[BaseException] | None = getattr(torch, "AcceleratorError", None)


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` says the device ran out of memory, whichever library raised it."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return bool(_OOM.search(str(exc)[:4000]))


def is_sticky(exc: BaseException) -> bool:
    """Whether `exc` is a CUDA error that poisons the process's context."""
    if is_oom(exc):
        return False
    if _ACCELERATOR_ERROR is not None and isinstance(exc, _ACCELERATOR_ERROR):
        return True
    return bool(_STICKY.search(str(exc)[:4000]))
