"""The units a device's ledger books an executor's figures in.

On a CUDA device `set_per_process_memory_fraction` caps the caching allocator's reserved
segments, not tensor bytes (`salusd/memory/reserve.py`), so a job's persistent state and its
call's estimate are booked as the executor's reserved figures (`persistent_reserved_bytes`,
`reserved_bytes`); an executor that sent none is booked its exact bytes. On a CPU device memory
is accounted in exact bytes: the reserved figures are ignored there.
"""

from __future__ import annotations

from salus.daemon.wire.executor_ops import Attached, Estimated, Loaded


def booked_bytes(device_kind: str, exact: int, reserved: int | None) -> int:
    """Bytes to book of an executor's figures: the `reserved` one on a CUDA device
    (`device_kind` "cuda") when it sent one, else the `exact` one."""
    return reserved if device_kind == "cuda" and reserved is not None else exact


def booked_persistent(device_kind: str, reply: Attached | Loaded) -> int:
    """The persistent bytes to book of an attach or load reply."""
    return booked_bytes(device_kind, reply.persistent_bytes, reply.persistent_reserved_bytes)


def booked_estimate(device_kind: str, reply: Estimated) -> int:
    """The ephemeral bytes to book of an estimate that succeeded."""
    return booked_bytes(device_kind, reply.bytes, reply.reserved_bytes)
