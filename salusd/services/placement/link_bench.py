"""Link side of the benchmark phase: latency and bandwidth between every pair of devices.

Either measured, by timed point-to-point exchanges over the default torch.distributed process
group (`benchmark_links`, with `benchmark_cluster` adding each rank's device benchmark), or read
off a known `Topology` (`links_from_topology`).
"""

from __future__ import annotations

import time
from itertools import combinations, permutations

import networkx as nx
import torch
import torch.distributed as dist

from salus.daemon.services.collectives.topology import Topology

from .device_bench import benchmark_device
from .profile import ClusterProfile, DeviceProfile, LinkProfile


def benchmark_links(
    device: torch.device | str = "cpu",
    *,
    small_bytes: int = 8,
    large_bytes: int = 4 * 2**20,
    rounds: int = 10,
    attempts: int = 3,
) -> LinkProfile:
    """Measure every pair of ranks of the default process group; every rank must call this.

    Pairs take turns (a barrier between them) so no exchange competes with another. For each
    pair the fastest of `rounds` ping-pong round trips (the one least disturbed by other load)
    of a `small_bytes` and of a `large_bytes` message gives two one-way times; the
    latency-bandwidth line through them gives the bandwidth (bytes/s, the slope) and the
    latency (seconds, the intercept). The result is symmetric, indexed by rank, and the same
    on every rank. Tensors live on `device` (a CUDA device with NCCL). When a pair's large
    message was not slower than its small one (a measurement disturbed by other load), every
    rank measures every pair again, up to `attempts` times in all, and then raises the same
    RuntimeError: every rank sees the same gathered times, so the ranks stay in step.
    """
    if not 0 < small_bytes < large_bytes:
        raise ValueError(f"need 0 < small_bytes < large_bytes, got {small_bytes}, {large_bytes}")
    if attempts < 1:
        raise ValueError(f"need attempts >= 1, got {attempts}")
    rank, world = dist.get_rank(), dist.get_world_size()
    small = torch.zeros(small_bytes, dtype=torch.uint8, device=device)
    large = torch.zeros(large_bytes, dtype=torch.uint8, device=device)
    for _ in range(attempts):
        rows = _measure_pairs(small, large, rank, world, rounds)
        disturbed = [(i, j, ts, tl) for i, j, ts, tl in rows if tl <= ts]
        if not disturbed:
            break
    else:
        i, j, t_small, t_large = disturbed[0]
        raise RuntimeError(
            f"ranks {i}<->{j}: {large_bytes} bytes took {t_large:.3g} s, no longer than "
            f"{small_bytes} bytes ({t_small:.3g} s) in each of {attempts} attempts; raise "
            "large_bytes")
    lat = [[0.0] * world for _ in range(world)]
    bw = [[0.0] * world for _ in range(world)]
    for i, j, t_small, t_large in rows:
        bandwidth = (large_bytes - small_bytes) / (t_large - t_small)
        lat[i][j] = lat[j][i] = max(0.0, t_small - small_bytes / bandwidth)
        bw[i][j] = bw[j][i] = bandwidth
    return LinkProfile(tuple(map(tuple, lat)), tuple(map(tuple, bw)))


def _measure_pairs(small: torch.Tensor, large: torch.Tensor, rank: int, world: int,
                   rounds: int) -> list[tuple[int, int, float, float]]:
    """Every pair's (i, j, small one-way s, large one-way s), pairs in turn; the same list on
    every rank."""
    measured: list[tuple[int, int, float, float]] = []
    for i, j in combinations(range(world), 2):
        if rank in (i, j):
            peer = j if rank == i else i
            t_small = _one_way_s(small, rank == i, peer, rounds)
            t_large = _one_way_s(large, rank == i, peer, rounds)
            if rank == i:
                measured.append((i, j, t_small, t_large))
        dist.barrier()
    gathered: list[list[tuple[int, int, float, float]]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, measured)
    return [row for rows in gathered for row in rows]


def _one_way_s(buf: torch.Tensor, initiator: bool, peer: int, rounds: int) -> float:
    """Half the fastest round trip, in seconds, of `buf` to `peer` and back (one warm-up)."""
    trips = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        if initiator:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        trips.append(time.perf_counter() - start)
    return min(trips[1:]) / 2


def benchmark_cluster(
    memory_bytes: int,
    device: torch.device | str = "cpu",
    *,
    min_run_time_s: float = 0.2,
) -> ClusterProfile:
    """Benchmark this rank's device and every link; every rank must call this.

    `memory_bytes` is this rank's budget (bytes); each kernel of `benchmark_device` runs at
    least `min_run_time_s` seconds. Devices appear in rank order, which is the pipeline order
    the allocators assume; each is named "rank<r>". Returns the same profile on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = benchmark_device(device, memory_bytes, name=f"rank{rank}",
                            min_run_time_s=min_run_time_s)
    devices: list[DeviceProfile | None] = [None] * world
    dist.all_gather_object(devices, mine)
    links = benchmark_links(device)
    return ClusterProfile(tuple(d for d in devices if d is not None), links)


def links_from_topology(topology: Topology, latency_s: float = 0.0) -> LinkProfile:
    """Links between the topology's devices (in `topology.devices()` order) from its capacities.

    Point-to-point traffic does not relay through a third device, so the bandwidth from i to j
    is the sum of the direct i->j links when there are any (NCCL uses parallel NVLinks
    together), else the maximum flow (networkx) from i to j through switches only. Capacities
    in GB/s become bytes/s. A `Topology` has no latencies: every pair gets `latency_s` seconds.
    """
    graph = nx.DiGraph()
    for src, dst, gbps, _kind in topology.edges():
        cap = graph.get_edge_data(src, dst, {"capacity": 0.0})["capacity"]
        graph.add_edge(src, dst, capacity=cap + gbps * 1e9)
    ids = topology.devices()
    n = len(ids)
    lat = [[0.0 if i == j else latency_s for j in range(n)] for i in range(n)]
    bw = [[0.0] * n for _ in range(n)]
    for i, j in permutations(range(n), 2):
        if graph.has_edge(ids[i], ids[j]):
            bw[i][j] = graph[ids[i]][ids[j]]["capacity"]
        else:
            relays = graph.subgraph([ids[i], ids[j], *topology.switches()])
            bw[i][j] = float(nx.maximum_flow_value(relays, ids[i], ids[j]))
        if bw[i][j] <= 0:
            raise ValueError(f"topology {topology.name!r} has no path from {ids[i]} to {ids[j]}")
    return LinkProfile(tuple(map(tuple, lat)), tuple(map(tuple, bw)))
