"""Gradient buckets as DDP makes them: parameters in reverse order, one dtype and device per
bucket, flattened into buffers of at most `bucket_bytes` bytes (a larger parameter alone).

Reverse order because backward produces the last layers' gradients first; a bucket is the unit
one allreduce moves, so a few large buffers replace many small calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb=25``, in bytes."""


@dataclass(frozen=True)
class Bucket:
    """Indices into the parameter list, in flattening order, and the buffer's element count."""

    params: tuple[int, ...]
    numel: int


def plan_buckets(params: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """Buckets of ``params`` (see the module docstring); ``bucket_bytes`` caps a buffer."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes}")
    done: list[Bucket] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        members, numel = open_.get(key, ([], 0))
        if members and (numel + p.numel()) * p.element_size() > bucket_bytes:
            done.append(Bucket(tuple(members), numel))
            members, numel = [], 0
        open_[key] = (members + [i], numel + p.numel())
    done += [Bucket(tuple(m), n) for m, n in open_.values() if m]
    return done


def flatten_grads(bucket: Bucket, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new contiguous buffer of the bucket's gradients (zeros where ``.grad`` is None)."""
    parts = []
    for i in bucket.params:
        grad = params[i].grad
        parts.append(params[i].new_zeros(params[i].numel()) if grad is None else grad.reshape(-1))
    return torch.cat(parts)


def unflatten_grads(flat: torch.Tensor, bucket: Bucket, params: Sequence[torch.Tensor]) -> None:
    """Write ``flat`` back into the bucket's ``.grad`` tensors (made where they are None)."""
    offset = 0
    for i in bucket.params:
        p = params[i]
        part = flat[offset : offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.copy_(part)
        offset += p.numel()
