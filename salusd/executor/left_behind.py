"""What a swap-out leaves on the device: bytes still allocated there once the job's state moved.

The executor moves every tensor its walk of the job's objects finds (`state_move.py`); tensors
it cannot reach (one inside a plain object's attribute, a cache a closure keeps) stay on the
device, and so does a moved storage that something else still references. The caching
allocator's `memory_allocated` counts them all, with what the process's other jobs hold; the
part those jobs' objects hold is subtracted, so an executor with one job reports exactly what
that job left. The measure reads the allocator's counters, after a synchronisation of the
device (a copy in flight has not yet released its source); it is 0 on any other device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from salus.daemon.executor.state_move import destinations


def device_bytes_left(device: torch.device, others: Iterable[object] = ()) -> int:
    """Bytes allocated on the CUDA `device` now, less the distinct storages on it that the
    objects `others` (the process's other jobs') hold; 0 for a device that is not CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize(device)
    held: dict[int, int] = {}
    for t, _ in destinations(others, device):
        if t.device == device and t.layout == torch.strided:
            storage = t.untyped_storage()
            held[storage._cdata] = storage.nbytes()
    return max(0, torch.cuda.memory_allocated(device) - sum(held.values()))
