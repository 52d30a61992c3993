"""The collective exchange that serves one step's batch from the replicas' level-2 shards.

Every replica calls `exchange` with the sample indices it wants for the step; sample ``i`` is
owned by rank ``i % N``. The protocol, over one (gloo) process group:

1. all-gather of one int64 per rank: how many indices it wants, or -1 if one is out of range
   (then every rank raises the same ``IndexError`` and nothing else moves);
2. all-gather of every rank's indices, padded to the longest list with -1;
3. each rank loads, once each, the requested samples it owns (level 2, else level 1 or the
   source, then decode) and pickles, per requesting peer, the samples that peer asked for in
   the peer's order;
4. all-to-all of the payload sizes (int64 bytes per peer), then all-to-all of the payloads
   (uint8, uneven splits);
5. each rank unpickles and fills its list in request order: its own samples directly, the others
   from their owners' payloads in order.

Steps 4 and 5 are skipped, on every rank alike, when no rank wants a sample another rank owns
(every rank sees the same table after step 2). Payloads are pickled: peers of one gang run one
owner's code, as the executors do.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from salus.daemon.services.sparse_allreduce import all_gather

T = TypeVar("T")


@dataclass(frozen=True)
class Exchanged(Generic[T]):
    """What one rank got: ``samples`` in request order, and the bytes it sent and received."""

    samples: list[T]
    sent_bytes: int
    received_bytes: int


def exchange(group: dist.ProcessGroup, wanted: Sequence[int], length: int,
             load: Callable[[int], T]) -> Exchanged[T]:
    """Serve ``wanted`` (indices into a data set of ``length`` samples) across ``group``.

    ``load(i)`` returns sample ``i`` for an index this rank owns. Collective: every rank of
    ``group`` calls it once per step (see the module docstring).
    """
    n, me = dist.get_world_size(group), dist.get_rank(group)
    valid = all(0 <= i < length for i in wanted)
    counts = torch.empty(n, dtype=torch.int64)
    all_gather(counts, torch.tensor([len(wanted) if valid else -1]), group)
    bad = [r for r, c in enumerate(counts.tolist()) if c < 0]
    if bad:
        raise IndexError(f"rank(s) {bad} asked for sample indices outside [0, {length}); "
                         "no sample was exchanged on any rank")
    width = int(counts.max())
    if width == 0:
        return Exchanged([], 8 * (n - 1), 8 * (n - 1))
    mine = torch.full((width,), -1, dtype=torch.int64)
    mine[: len(wanted)] = torch.tensor(list(wanted), dtype=torch.int64)
    table = torch.empty(n * width, dtype=torch.int64)
    all_gather(table, mine, group)
    requests = [table[r * width : r * width + int(counts[r])].tolist() for r in range(n)]
    sent = 8 * (n - 1) * (1 + width)  # the two all-gathers (ring)

    loaded = {i: load(i) for r in range(n) for i in requests[r] if i % n == me}
    if all(i % n == r for r in range(n) for i in requests[r]):
        return Exchanged([loaded[i] for i in wanted], sent, sent)

    payloads = [
        b"" if r == me else pickle.dumps([loaded[i] for i in requests[r] if i % n == me])
        for r in range(n)
    ]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    recv_sizes = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8) if any(
        payloads) else torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes.tolist(),
                           input_split_sizes=send_sizes.tolist(), group=group)
    sent += 8 * (n - 1) + send.numel()

    from_owner: dict[int, list[T]] = {}
    offset = 0
    for r, size in enumerate(recv_sizes.tolist()):
        if r != me and size:
            from_owner[r] = pickle.loads(recv[offset : offset + size].numpy().tobytes())
        offset += size
    positions = dict.fromkeys(from_owner, 0)
    samples = []
    for i in wanted:
        owner = i % n
        if owner == me:
            samples.append(loaded[i])
        else:
            samples.append(from_owner[owner][positions[owner]])
            positions[owner] += 1
    return Exchanged(samples, sent, 8 * (n - 1) * (1 + width) + 8 * (n - 1) + recv.numel())
