"""The units a device's ledger books an executor's figures in.

On a CUDA device `set_per_process_memory_fraction` caps the caching allocator's reserved
segments, not tensor bytes (`salusd/memory/reserve.py`), so a job's persistent state and its
call's estimate are booked as the executor's reserved figures (`persistent_reserved_bytes`,
`reserved_bytes`); an executor that sent none is booked its exact bytes. On a CPU device memory
is accounted in exact bytes: the reserved figures are ignored there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def booked_bytes(device_kind: str, meta: Mapping[str, Any], exact: str, reserved: str) -> int:
    """Bytes to book of the executor's reply `meta`: its `reserved` figure on a CUDA device
    (`device_kind` "cuda") when it sent one, else its `exact` one (0 when absent)."""
    if device_kind == "cuda" and type(meta.get(reserved)) is int:
        return int(meta[reserved])
    return int(meta.get(exact, 0))


def booked_persistent(device_kind: str, meta: Mapping[str, Any]) -> int:
    """The persistent bytes to book of an attach or load reply."""
    return booked_bytes(device_kind, meta, "persistent_bytes", "persistent_reserved_bytes")


def booked_estimate(device_kind: str, meta: Mapping[str, Any]) -> int:
    """The ephemeral bytes to book of an estimate that succeeded."""
    return booked_bytes(device_kind, meta, "bytes", "reserved_bytes")
