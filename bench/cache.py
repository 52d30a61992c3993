"""Data cache: epoch 1 from a slow source against later epochs from the caches, and how much
read time the run-ahead thread hides behind compute.

Usage: .venv/bin/python bench/cache.py [--quick] [--files N] [--file-bytes B] [--delay S]

The source is a local directory read through ``slowfile://``: fsspec's local filesystem with a
fixed sleep of ``--delay`` seconds (default 0.01) before every file read, as an NFS server under
load gives (each small-file read pays round trips and queueing). Samples are float32 tensors
(``--file-bytes`` each), decoded with ``torch.frombuffer``; batches hold 16 samples.

- ``single_process``: epoch 1 (cold, every file from the source), epoch 2 (level 2: decoded
  samples in memory), and an epoch of a new data set over the same cache directory with level 2
  off (level 1: files on local disk, mostly in the page cache). Throughput ratios are against
  epoch 1.
- ``overlap``: a cold epoch with compute per batch (matrix products for about as long as one
  batch's read took in epoch 1), once reading each batch then computing, once with ``batches``
  reading ahead. ``hidden_read_share`` = 1 - (time the consumer waited) / (time spent reading).
- ``gang``: 2 processes (gloo on loopback) with level 2 sharded: each reads half the files from
  the source in epoch 1; epoch 2 is served from the replicas' memory by the exchange.
Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from salus.daemon.services.comm import Comm
from salus.daemon.services.datacache import CachedDataset
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

BATCH = 16
WORLD = 2
PG_TIMEOUT_S = 300
RUN_TIMEOUT_S = 1800


class SlowLocalFileSystem(LocalFileSystem):
    """The local filesystem, with ``delay_s`` seconds of sleep before each whole-file read."""

    protocol = ("slowfile",)

    def __init__(self, delay_s: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        time.sleep(self.delay_s)
        return bytes(super().cat_file(path, start, end, **kwargs))


fsspec.register_implementation("slowfile", SlowLocalFileSystem, clobber=True)


def decode(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


def write_source(root: Path, files: int, file_bytes: int) -> None:
    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(files):
        data = torch.randn(file_bytes // 4, generator=g).numpy().tobytes()
        (root / f"sample{i:06d}.bin").write_bytes(data)


def batches_of(indices: Sequence[int]) -> list[list[int]]:
    return [list(indices[i : i + BATCH]) for i in range(0, len(indices), BATCH)]


def timed_epoch(ds: CachedDataset[torch.Tensor], batches: list[list[int]]) -> float:
    """Seconds to read every batch, one after another, with no compute."""
    start = time.perf_counter()
    for b in batches:
        ds.get_batch(b)
    return time.perf_counter() - start


def throughput(seconds: float, samples: int, file_bytes: int) -> dict[str, float]:
    return {
        "seconds": round(seconds, 4),
        "samples_per_s": round(samples / seconds, 1),
        "mb_per_s": round(samples * file_bytes / seconds / 1e6, 2),
    }


def make_compute(seconds: float) -> Callable[[], None]:
    """A compute step of about ``seconds`` seconds: 256 x 256 matrix products, calibrated."""
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - start) / 20
    reps = max(1, round(seconds / per))

    def compute() -> None:
        for _ in range(reps):
            a @ a

    return compute


def single_process(tmp: Path, url: str, files: int, file_bytes: int,
                   options: dict[str, Any]) -> dict[str, Any]:
    order = batches_of(range(files))
    ds = CachedDataset(url, decode, cache_dir=tmp / "cache", cache_bytes=2 * files * file_bytes,
                       storage_options=options)
    t1 = timed_epoch(ds, order)
    reads_after_epoch1 = ds.stats.source_reads
    t2 = timed_epoch(ds, order)
    disk_only = CachedDataset(url, decode, cache_dir=tmp / "cache",
                              cache_bytes=2 * files * file_bytes, memory_bytes=0,
                              storage_options=options)
    t_disk = timed_epoch(disk_only, order)
    return {
        "epoch1": throughput(t1, files, file_bytes) | {"source_reads": reads_after_epoch1},
        "epoch2": throughput(t2, files, file_bytes)
        | {"source_reads": ds.stats.source_reads - reads_after_epoch1},
        "level1_only": throughput(t_disk, files, file_bytes)
        | {"source_reads": disk_only.stats.source_reads},
        "epoch2_speedup_vs_epoch1": round(t1 / t2, 1),
        "level1_speedup_vs_epoch1": round(t1 / t_disk, 1),
        "epoch1_batch_read_s": t1 / len(order),
    }


def overlap(tmp: Path, url: str, files: int, file_bytes: int, options: dict[str, Any],
            compute_s: float) -> dict[str, Any]:
    order = batches_of(range(files))
    compute = make_compute(compute_s)
    serial = CachedDataset(url, decode, cache_dir=tmp / "serial", cache_bytes=0,
                           storage_options=options)
    start = time.perf_counter()
    for b in order:
        serial.get_batch(b)
        compute()
    t_serial = time.perf_counter() - start
    ahead = CachedDataset(url, decode, cache_dir=tmp / "ahead", cache_bytes=0,
                          storage_options=options)
    start = time.perf_counter()
    for _batch in ahead.batches(order, run_ahead=2):
        compute()
    t_ahead = time.perf_counter() - start
    st = ahead.stats
    return {
        "compute_s_per_batch": round(compute_s, 4),
        "read_then_compute_epoch_s": round(t_serial, 3),
        "run_ahead_epoch_s": round(t_ahead, 3),
        "speedup": round(t_serial / t_ahead, 3),
        "read_s": round(st.read_seconds, 3),
        "waited_s": round(st.wait_seconds, 3),
        "hidden_read_share": round(1 - st.wait_seconds / st.read_seconds, 3),
    }


def _gang_worker(rank: int, port: int, url: str, cache: str, files: int,
                 options: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    init_loopback(rank, WORLD, port, timeout_s=PG_TIMEOUT_S)
    comm = Comm()
    ds = CachedDataset(url, decode, cache_dir=cache, cache_bytes=2 << 30, comm=comm,
                       storage_options=options)
    per_step = BATCH * WORLD
    steps = [list(range(s, s + per_step)) for s in range(0, files - per_step + 1, per_step)]
    mine = [s[rank * BATCH : (rank + 1) * BATCH] for s in steps]
    record: dict[str, Any] = {}
    for epoch in (1, 2):
        reads = ds.stats.source_reads
        sent = ds.stats.exchange_sent_bytes
        dist.barrier()
        start = time.perf_counter()
        for b in mine:
            ds.get_batch(b)
        record[f"epoch{epoch}"] = {
            "seconds": time.perf_counter() - start,
            "source_reads": ds.stats.source_reads - reads,
            "exchange_sent_bytes": ds.stats.exchange_sent_bytes - sent,
            "samples": sum(len(b) for b in mine),
        }
    record["held"] = len(ds.held())
    torch.save(record, Path(out) / f"rank{rank}.pt")
    comm.close()
    leave_group()


def gang(tmp: Path, url: str, files: int, file_bytes: int,
         options: dict[str, Any]) -> dict[str, Any]:
    run_local_group(_gang_worker, WORLD,
                    (free_port(), url, str(tmp / "gang"), files, options, str(tmp)),
                    timeout_s=RUN_TIMEOUT_S)
    ranks = [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]
    out: dict[str, Any] = {"held_per_rank": [r["held"] for r in ranks]}
    for epoch in ("epoch1", "epoch2"):
        seconds = max(r[epoch]["seconds"] for r in ranks)
        samples = sum(r[epoch]["samples"] for r in ranks)
        out[epoch] = throughput(seconds, samples, file_bytes) | {
            "source_reads_per_rank": [r[epoch]["source_reads"] for r in ranks],
            "exchange_sent_bytes_per_rank": [r[epoch]["exchange_sent_bytes"] for r in ranks],
        }
    out["epoch2_speedup_vs_epoch1"] = round(out["epoch1"]["seconds"] / out["epoch2"]["seconds"],
                                            1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer files (under ~2 minutes)")
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--file-bytes", type=int, default=64 * 1024)
    parser.add_argument("--delay", type=float, default=0.01, help="seconds per source read")
    args = parser.parse_args()
    files = args.files or (256 if args.quick else 1024)
    options = {"delay_s": args.delay}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        write_source(tmp / "src", files, args.file_bytes)
        url = f"slowfile://{tmp / 'src'}"
        print(f"{files} files of {args.file_bytes} bytes, {args.delay} s per read",
              file=sys.stderr)
        single = single_process(tmp, url, files, args.file_bytes, options)
        batch_read_s = single.pop("epoch1_batch_read_s")
        result = {
            "source": {"files": files, "file_bytes": args.file_bytes, "read_delay_s": args.delay,
                       "batch": BATCH},
            "single_process": single,
            "overlap": overlap(tmp, url, files, args.file_bytes, options, batch_read_s),
            "gang": gang(tmp, url, files, args.file_bytes, options),
        }
    result["summary"] = {
        "epoch2_vs_epoch1_throughput": single["epoch2_speedup_vs_epoch1"],
        "level1_vs_epoch1_throughput": single["level1_speedup_vs_epoch1"],
        "hidden_read_share": result["overlap"]["hidden_read_share"],
        "gang_epoch2_vs_epoch1_throughput": result["gang"]["epoch2_speedup_vs_epoch1"],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
