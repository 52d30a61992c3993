"""JAX and TensorFlow held to a script job's budget on its GPU, through their own settings.

torch's caching allocator is capped by the executor (`cap.py`); JAX (XLA) and TensorFlow keep
allocators of their own that torch's cap does not reach, and by default XLA takes 75% of the
GPU at its first use and TensorFlow all of it. So before a script placed on a GPU runs, its
environment gets what makes them take memory as needed and no more than the job's budget:
`XLA_PYTHON_CLIENT_PREALLOCATE=false`, the budget's fraction of the device in
`XLA_PYTHON_CLIENT_MEM_FRACTION` (and `XLA_CLIENT_MEM_FRACTION`, the name newer JAX reads),
and `TF_FORCE_GPU_ALLOW_GROWTH=true`. A variable the script's caller set is left as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

FRACTION_DIGITS = 4  # rounded down: the cap is never above the budget


def framework_memory_env(device: str, budget_bytes: int, total_bytes: int | None,
                         env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to the script's environment `env` for a job placed on torch
    `device` ("cuda:0", "cpu") with `budget_bytes` of the device's `total_bytes` (None:
    unknown): none on a CPU device or without the total, and none that `env` already sets."""
    if not device.startswith("cuda") or not total_bytes or total_bytes <= 0:
        return {}
    scale = 10 ** FRACTION_DIGITS
    fraction = min(1.0, max(1, math.floor(budget_bytes / total_bytes * scale)) / scale)
    text = f"{fraction:.{FRACTION_DIGITS}f}"
    wanted = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": text,
              "XLA_CLIENT_MEM_FRACTION": text, "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    return {k: v for k, v in wanted.items() if k not in env}
