"""Start a group of real processes on this machine, joined by torch.distributed on loopback.

This is how salusd's services run several processes for tests, benchmarks and single-node
multi-process jobs: ``run_local_group`` starts the workers with ``torch.multiprocessing`` and
bounds the whole run by a deadline; each worker calls ``init_loopback`` to join a gloo process
group over ``tcp://127.0.0.1:<port>``. NCCL on GPUs works the same with ``backend="nccl"``
(one device per rank, chosen by the worker before it joins).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from salus.daemon.wire.address import LOOPBACK, free_port

__all__ = ["LOOPBACK", "free_port", "init_loopback", "init_through_store", "leave_group",
           "run_local_group"]


def init_loopback(
    rank: int,
    world_size: int,
    port: int,
    *,
    timeout_s: float = 120.0,
    backend: str = "gloo",
) -> None:
    """Join the default process group of ``world_size`` ranks over tcp://127.0.0.1:port.

    ``timeout_s`` (seconds) bounds the rendezvous and every later collective of the group, so a
    missing or stuck peer becomes an error instead of a hang. Gloo is pinned to the loopback
    interface when the machine has one (an already set ``GLOO_SOCKET_IFNAME`` wins), so that it
    does not pick an external interface for traffic between local processes.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}; use free_port() to pick one")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive seconds, got {timeout_s}")
    _pin_gloo_to_loopback()
    dist.init_process_group(
        backend,
        init_method=f"tcp://{LOOPBACK}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_through_store(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    key: str,
    *,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    loopback: bool = False,
) -> int:
    """Join the default process group of ``world_size`` ranks (on several hosts) through the
    TCP store another process hosts on host:port, under the prefix ``key``; returns the
    generation joined.

    A long-lived store outlives many groups of one ``key`` (a job submitted again, a gang
    restarted): each rank counts its arrival under ``key`` and takes generation
    ``(arrivals - 1) // world_size``, so every rank of one rendezvous lands in the same fresh
    namespace ``key/generation`` as long as each rendezvous is joined by all its ranks once.
    ``timeout_s`` bounds reaching the store, the rendezvous and every later collective.
    ``loopback``: every rank is on this machine, so gloo is pinned to it as `init_loopback`
    pins it.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if loopback:
        _pin_gloo_to_loopback()
    base = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    generation = (base.add(f"{key}/arrivals", 1) - 1) // world_size
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{key}/{generation}/", base),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return generation


def _preload_torch() -> None:
    """Have the fork server import torch when it starts, beside ``__main__`` (Python's
    default); once the server runs this changes nothing."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(["__main__", "torch"])


def _pin_gloo_to_loopback() -> None:
    """Make gloo use the loopback interface when the machine has one (an already set
    ``GLOO_SOCKET_IFNAME`` wins)."""
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def leave_group() -> None:
    """Leave the default process group and every sub-group, after all ranks got here.

    The barrier matters: gloo aborts the process (``terminate called without an active
    exception``) whose groups are destroyed while a peer is still inside a collective of one of
    them, which a busy machine makes likely at the end of a run.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


def run_local_group(
    fn: Callable[..., object],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float,
) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and wait for all of them.

    The processes come from Python's fork server (the ``forkserver`` start method, which
    PyTorch names beside ``spawn`` as safe for torch, CUDA included), started with torch
    imported: a process's start then skips torch's import (about 2 s of CPU each), and it
    shares nothing else with this one. So ``fn`` must be importable by name (a module-level
    function), as with ``spawn``, and the processes get the environment this process had when
    its first group started (the fork server's): pass what changes later in ``args``.

    Returns when every process exited cleanly. A process that raises makes this raise
    ``torch.multiprocessing.ProcessRaisedException`` carrying its traceback (one that dies
    without raising: ``ProcessExitedException``); the others are stopped. If the group is still
    running ``timeout_s`` seconds after the start, every process is killed and ``TimeoutError``
    is raised.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive seconds, got {timeout_s}")
    _preload_torch()
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                name = getattr(fn, "__qualname__", repr(fn))
                raise TimeoutError(
                    f"{nprocs} processes running {name} did not finish within {timeout_s} s; "
                    "all were killed"
                )
    finally:
        # Also reached on an error or an interrupt in this process: leave no child behind.
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
