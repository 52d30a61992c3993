"""Local process groups: free ports, a real 2-process gloo all_reduce, failures and deadlines."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

WORLD = 2
PG_TIMEOUT_S = 20
RUN_TIMEOUT_S = 60
HANG_TIMEOUT_S = 5


def _contribution(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64) * (rank + 1) - rank


def _all_reduce(rank: int, port: int, out_dir: str) -> None:
    init_loopback(rank, WORLD, port, timeout_s=PG_TIMEOUT_S)
    x = _contribution(rank)
    dist.all_reduce(x)
    record = {
        "sum": x.tolist(),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    leave_group()


def _raise_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def _hang(rank: int, out_dir: str) -> None:
    (Path(out_dir) / f"pid{rank}").write_text(str(os.getpid()))
    time.sleep(3600)


def test_free_port_is_bindable_on_loopback() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()


@pytest.mark.slow
def test_two_gloo_processes_all_reduce(tmp_path: Path) -> None:
    run_local_group(_all_reduce, WORLD, (free_port(), str(tmp_path)), timeout_s=RUN_TIMEOUT_S)
    want = torch.stack([_contribution(r) for r in range(WORLD)]).sum(0)
    for rank in range(WORLD):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["sum"] == want.tolist()
        assert (record["rank"], record["world"], record["backend"]) == (rank, WORLD, "gloo")
        if os.path.exists("/sys/class/net/lo"):
            assert record["ifname"] == os.environ.get("GLOO_SOCKET_IFNAME", "lo")


@pytest.mark.slow
def test_child_exception_surfaces_with_its_message() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(mp.ProcessRaisedException, match="rank one refuses") as info:
        run_local_group(_raise_on_rank_one, WORLD, timeout_s=RUN_TIMEOUT_S)
    assert info.value.error_index == 1
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.slow
def test_hanging_group_is_killed_at_the_deadline(tmp_path: Path) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(TimeoutError, match=f"within {HANG_TIMEOUT_S} s"):
        run_local_group(_hang, WORLD, (str(tmp_path),), timeout_s=HANG_TIMEOUT_S)
    assert set(multiprocessing.active_children()) <= before
    # Workers that got as far as recording their pid are gone, not merely orphaned.
    for pid_file in tmp_path.glob("pid*"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


@pytest.mark.parametrize(
    ("nprocs", "timeout_s", "match"), [(0, 1.0, "nprocs"), (1, 0.0, "timeout_s")]
)
def test_run_local_group_rejects_bad_arguments(nprocs: int, timeout_s: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_local_group(_raise_on_rank_one, nprocs, timeout_s=timeout_s)


@pytest.mark.parametrize(
    ("rank", "world_size", "port", "timeout_s", "match"),
    [
        (2, 2, 1234, 1.0, "rank"),
        (-1, 2, 1234, 1.0, "rank"),
        (0, 0, 1234, 1.0, "world_size"),
        (0, 1, 0, 1.0, "port"),
        (0, 1, 70000, 1.0, "port"),
        (0, 1, 1234, -1.0, "timeout_s"),
    ],
)
def test_init_loopback_rejects_bad_arguments(
    rank: int, world_size: int, port: int, timeout_s: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        init_loopback(rank, world_size, port, timeout_s=timeout_s)
    assert not dist.is_initialized()
