"""The multi-level data cache: level-1 LRU on disk, level-2 sharding across real processes.

Sample ``i`` is a file of float32 values made here (`sample_values`); expected samples are
computed from those values, never through the cache. That no source file is read is shown by
moving the source away, not by the cache's own counters.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from salus.daemon.services.comm import Comm
from salus.daemon.services.datacache import CachedDataset
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

N_SAMPLES = 24
PER_RANK = 3
PG_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 85


def sample_values(i: int) -> torch.Tensor:
    """Sample i's content: 10 + i % 4 float32 values (sizes differ between samples)."""
    return torch.arange(10 + i % 4, dtype=torch.float32) + 100 * i


def decode(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


def write_source(root: Path, n: int = N_SAMPLES, size: int | None = None) -> list[Path]:
    """``n`` sample files under ``root`` (names sort in index order); ``size``: fixed bytes."""
    root.mkdir(parents=True)
    paths = []
    for i in range(n):
        path = root / f"s{i:04d}.bin"
        path.write_bytes(bytes([i]) * size if size else sample_values(i).numpy().tobytes())
        paths.append(path)
    return paths


def cached_files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir()}


def sha(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


def test_level1_keeps_under_its_cap_and_evicts_the_least_recently_used(tmp_path: Path) -> None:
    write_source(tmp_path / "src", n=6, size=1000)
    cache = tmp_path / "cache"
    ds = CachedDataset(str(tmp_path / "src"), bytes, cache_dir=cache, cache_bytes=3500,
                       memory_bytes=0)
    for i in (0, 1, 2, 0, 3):  # 0 read again: 1 is now the least recently used
        assert ds[i] == bytes([i]) * 1000
    files = cached_files(cache)
    assert sum(files.values()) <= 3500
    assert set(files) == {sha(ds.url(i)) for i in (0, 2, 3)}
    assert ds.stats.disk.hits == 1 and ds.stats.disk.evictions == 1
    for i in (4, 5, 0):
        ds[i]
        assert sum(cached_files(cache).values()) <= 3500
    assert set(cached_files(cache)) == {sha(ds.url(i)) for i in (4, 5, 0)}


def test_a_file_larger_than_the_cap_is_served_but_not_kept(tmp_path: Path) -> None:
    write_source(tmp_path / "src", n=2, size=2000)
    ds = CachedDataset(str(tmp_path / "src"), bytes, cache_dir=tmp_path / "c", cache_bytes=1000,
                       memory_bytes=0)
    assert ds[1] == bytes([1]) * 2000
    assert cached_files(tmp_path / "c") == {}


def test_second_epoch_reads_no_source_file(tmp_path: Path) -> None:
    write_source(tmp_path / "src")
    ds = CachedDataset(str(tmp_path / "src"), decode, cache_dir=tmp_path / "c",
                       cache_bytes=1 << 20)
    for i in range(N_SAMPLES):
        assert torch.equal(ds[i], sample_values(i))
    (tmp_path / "src").rename(tmp_path / "gone")
    for i in reversed(range(N_SAMPLES)):
        assert torch.equal(ds[i], sample_values(i))
    assert ds.stats.memory.hits == N_SAMPLES


def test_level1_survives_a_restart_without_the_source(tmp_path: Path) -> None:
    paths = write_source(tmp_path / "src")
    urls = [str(p) for p in paths]
    first = CachedDataset(urls, decode, cache_dir=tmp_path / "c", cache_bytes=1 << 20)
    for i in range(N_SAMPLES):
        first[i]
    for p in paths:
        p.unlink()
    again = CachedDataset(urls, decode, cache_dir=tmp_path / "c", cache_bytes=1 << 20)
    for i in range(N_SAMPLES):
        assert torch.equal(again[i], sample_values(i))
    assert again.stats.disk.hits == N_SAMPLES and again.stats.source_reads == 0


def test_level2_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    write_source(tmp_path / "src", n=4, size=100)
    ds = CachedDataset(str(tmp_path / "src"), bytes, cache_dir=tmp_path / "c",
                       cache_bytes=1 << 20, memory_bytes=250)
    for i in (0, 1, 0, 2):
        ds[i]
    assert ds.held() == [0, 2]
    assert ds.stats.memory.stored_bytes == 200


def slow_decode(raw: bytes) -> torch.Tensor:
    time.sleep(0.02)  # a read of 20 ms per sample
    return decode(raw)


def test_run_ahead_hides_reads_behind_compute(tmp_path: Path) -> None:
    write_source(tmp_path / "src")
    ds = CachedDataset(str(tmp_path / "src"), slow_decode, cache_dir=tmp_path / "c",
                       cache_bytes=1 << 20)
    batches = [list(range(i, i + 4)) for i in range(0, N_SAMPLES, 4)]
    got = []
    for batch in ds.batches(batches, run_ahead=2):
        time.sleep(0.15)  # compute: longer than the 80 ms read of the next batch
        got.append(batch)
    assert [torch.equal(s, sample_values(i)) for b, idx in zip(got, batches, strict=True)
            for s, i in zip(b, idx, strict=True)] == [True] * N_SAMPLES
    stats = ds.stats
    assert stats.read_seconds >= 0.02 * N_SAMPLES
    # Only the first batch is waited for in full.
    assert stats.wait_seconds < 0.5 * stats.read_seconds


def failing_decode(raw: bytes) -> torch.Tensor:
    raise RuntimeError("corrupt sample")


def test_a_read_error_reaches_the_consumer(tmp_path: Path) -> None:
    write_source(tmp_path / "src", n=2)
    ds = CachedDataset(str(tmp_path / "src"), failing_decode, cache_dir=tmp_path / "c",
                       cache_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="corrupt sample"):
        list(ds.batches([[0], [1]]))


def test_prefetch_fills_level2(tmp_path: Path) -> None:
    write_source(tmp_path / "src")
    ds = CachedDataset(str(tmp_path / "src"), decode, cache_dir=tmp_path / "c",
                       cache_bytes=1 << 20)
    ds.prefetch(range(5)).result(timeout=30)
    assert ds.held() == [0, 1, 2, 3, 4]
    ds.close()


def _step_indices(epoch: int, step: int, world: int) -> list[list[int]]:
    """The indices each rank wants at one step: a permutation per epoch, cut per rank."""
    perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()
    start = step * PER_RANK * world
    return [perm[start + r * PER_RANK : start + (r + 1) * PER_RANK] for r in range(world)]


def _worker(rank: int, port: int, world: int, root: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_loopback(rank, world, port, timeout_s=PG_TIMEOUT_S)
    comm = Comm()
    source = Path(root) / "src"
    ds = CachedDataset(str(source), decode, cache_dir=Path(root) / "cache", cache_bytes=1 << 20,
                       comm=comm)
    steps = N_SAMPLES // (PER_RANK * world)
    res: dict[str, Any] = {"epochs": []}
    for epoch in range(2):
        wanted = [_step_indices(epoch, s, world)[rank] for s in range(steps)]
        got = list(ds.batches(wanted))
        res["epochs"].append((wanted, got))
        if epoch == 0:
            res["held"] = ds.held()
            res["source_reads"] = ds.stats.source_reads
            dist.barrier()
            if rank == 0:
                source.rename(Path(root) / "gone")  # epoch 2 must not need the source
            dist.barrier()
    # Every rank asks for the same samples; then one rank asks for a sample that does not exist.
    res["same"] = ds.get_batch([0, 1, 2, 3, 5])
    res["empty"] = ds.get_batch([])
    try:
        ds.get_batch([N_SAMPLES] if rank == world - 1 else [0])
        res["index_error"] = ""
    except IndexError as exc:
        res["index_error"] = str(exc)
    res["after_error"] = ds.get_batch([rank])
    res["stats"] = ds.stats.snapshot()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    ds.close()
    comm.close()
    leave_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_level2_is_sharded_and_every_rank_gets_its_samples(tmp_path: Path, world: int) -> None:
    write_source(tmp_path / "src")
    run_local_group(_worker, world, (free_port(), world, str(tmp_path), str(tmp_path)),
                    timeout_s=JOIN_TIMEOUT_S)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for rank, res in enumerate(results):
        for wanted, got in res["epochs"]:
            for idx, batch in zip(wanted, got, strict=True):
                assert len(batch) == PER_RANK
                for i, sample in zip(idx, batch, strict=True):
                    assert torch.equal(sample, sample_values(i)), (rank, i)
        # Each rank holds exactly the samples it owns: 1/N of the data set.
        assert res["held"] == [i for i in range(N_SAMPLES) if i % world == rank]
        # Each file was read from the source once, by its owner.
        assert res["source_reads"] == N_SAMPLES // world
        assert res["stats"]["source_reads"] == N_SAMPLES // world
        assert res["stats"]["exchange_sent_bytes"] > 0
        assert [torch.equal(s, sample_values(i)) for s, i in zip(res["same"], [0, 1, 2, 3, 5],
                                                                  strict=True)] == [True] * 5
        assert res["empty"] == []
        assert f"rank(s) [{world - 1}]" in res["index_error"]
        assert torch.equal(res["after_error"][0], sample_values(rank))
