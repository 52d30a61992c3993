"""Communication as a service to jobs: collectives with the torch.distributed convention, PTO.

`Comm(group)` wraps a gang's process group: ``all_reduce`` (ring, Blink trees, hierarchical,
auto), ``broadcast``, ``all_gather``, ``reduce_scatter``, ``sparse_all_reduce`` (hierarchical
top-k with error feedback), ``all_reduce_gradients(model)`` (DDP-style buckets) and
``sharded_step(optimizer)`` (PTO). Bytes sent per replica are in ``comm.stats``.
"""

from salus.daemon.services.collectives import Work

from .buckets import BUCKET_BYTES, Bucket, plan_buckets
from .comm import ALGORITHMS, AUTO_SMALL_BYTES, AUTO_TREE_GAIN, Algorithm, Comm
from .pto import ShardedOptimizer
from .traffic import CommStats
from .tree import TreeAllreduce, fully_connected

__all__ = [
    "ALGORITHMS",
    "AUTO_SMALL_BYTES",
    "AUTO_TREE_GAIN",
    "BUCKET_BYTES",
    "Algorithm",
    "Bucket",
    "Comm",
    "CommStats",
    "ShardedOptimizer",
    "TreeAllreduce",
    "Work",
    "fully_connected",
    "plan_buckets",
]
