"""Job traces for the simulator: the native CSV, the Tiresias CSV, and a synthetic generator.

Native CSV (one job a row, header required, `MB` = MiB = 2**20 bytes, times in seconds)::

    job_id,submit_s,iterations,iter_s,persistent_mb,ephemeral_mb[,util][,priority]

`util` (share of a device the job keeps busy alone, (0, 1]) defaults to 1.0, `priority` (> 0)
to 1. Native jobs use one device each.

Tiresias CSV (`job_id,num_gpu,submit_time,iterations,model_name,duration,interval`, the trace of
the Tiresias simulator): iter_s = duration / iterations, memory from `model_sizes`, util 1.0,
and a job asking for g GPUs is a gang of g devices. `interval` (the trace's think time between
arrivals) is already folded into `submit_time` and is ignored.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from salus.scheduler.job import Job
from salus.scheduler.model_sizes import MIB, MODEL_SIZES, model_size

TraceFormat = Literal["native", "tiresias"]
NATIVE_COLUMNS = ("job_id", "submit_s", "iterations", "iter_s", "persistent_mb", "ephemeral_mb")
NATIVE_OPTIONAL = ("util", "priority")
TIRESIAS_COLUMNS = (
    "job_id", "num_gpu", "submit_time", "iterations", "model_name", "duration", "interval"
)


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a trace (immutable; `to_job` makes the scheduler's mutable `Job`).
    Sizes in bytes, times in seconds."""

    job_id: int
    submit_s: float
    iterations: int
    iter_s: float
    persistent_bytes: int
    ephemeral_bytes: int
    util: float = 1.0
    priority: float = 1.0
    gang: int = 1
    model: str = ""

    @property
    def duration_s(self) -> float:
        """Seconds the job runs alone on its devices."""
        return self.iterations * self.iter_s

    def to_job(self) -> Job:
        return Job(
            job_id=self.job_id,
            submit_s=self.submit_s,
            total_iterations=self.iterations,
            persistent_bytes=self.persistent_bytes,
            ephemeral_bytes=self.ephemeral_bytes,
            name=self.model,
            est_iter_s=self.iter_s,
            util=self.util,
            priority=self.priority,
            gang=self.gang,
        )


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, line and column."""


def load_trace(path: str | Path, fmt: TraceFormat | None = None) -> list[TraceJob]:
    """Read a trace file; `fmt` None picks the format from the header. Jobs come back in submit
    order (submit time, then job id)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    return parse_trace(text, fmt, source=str(path))


def parse_trace(
    text: str, fmt: TraceFormat | None = None, source: str = "<trace>"
) -> list[TraceJob]:
    """Parse trace text (see `load_trace`)."""
    rows = csv.reader(io.StringIO(text))
    header = next(rows, None)
    if header is None:
        raise TraceError(f"{source}: empty file; expected a CSV header")
    header = [h.strip().lower() for h in header]
    if fmt is None:
        fmt = "tiresias" if "num_gpu" in header else "native"
    if fmt == "native":
        parse_row = _native_row(header, source)
    elif fmt == "tiresias":
        parse_row = _tiresias_row(header, source)
    else:
        raise ValueError(f"unknown trace format {fmt!r}; choose native or tiresias")
    jobs: list[TraceJob] = []
    seen: dict[int, int] = {}
    for row in rows:
        if not row or all(not c.strip() for c in row) or row[0].lstrip().startswith("#"):
            continue
        where = f"{source}:{rows.line_num}"
        if len(row) != len(header):
            raise TraceError(f"{where}: {len(row)} fields, the header has {len(header)}")
        job = parse_row(dict(zip(header, (c.strip() for c in row), strict=True)), where)
        if job.job_id in seen:
            raise TraceError(f"{where}: job_id {job.job_id} repeats line {seen[job.job_id]}")
        seen[job.job_id] = rows.line_num
        jobs.append(job)
    if not jobs:
        raise TraceError(f"{source}: no jobs in the trace")
    return sorted(jobs, key=lambda j: (j.submit_s, j.job_id))


Row = dict[str, str]


def _need_columns(header: Sequence[str], need: Iterable[str], source: str, fmt: str) -> None:
    missing = [c for c in need if c not in header]
    if missing:
        raise TraceError(
            f"{source}: {fmt} trace lacks column(s) {', '.join(missing)}; header is "
            f"{','.join(header)}"
        )


def _native_row(header: Sequence[str], source: str) -> Callable[[Row, str], TraceJob]:
    _need_columns(header, NATIVE_COLUMNS, source, "native")
    unknown = [c for c in header if c not in NATIVE_COLUMNS + NATIVE_OPTIONAL]
    if unknown:
        raise TraceError(f"{source}: unknown native column(s) {', '.join(unknown)}")

    def parse(row: Row, where: str) -> TraceJob:
        return TraceJob(
            job_id=_int(row, "job_id", where, low=0),
            submit_s=_float(row, "submit_s", where, low=0.0),
            iterations=_int(row, "iterations", where, low=1),
            iter_s=_float(row, "iter_s", where, low=0.0, strict=True),
            persistent_bytes=round(_float(row, "persistent_mb", where, low=0.0) * MIB),
            ephemeral_bytes=round(_float(row, "ephemeral_mb", where, low=0.0) * MIB),
            util=_float(row, "util", where, low=0.0, strict=True, high=1.0, default=1.0),
            priority=_float(row, "priority", where, low=0.0, strict=True, default=1.0),
        )

    return parse


def _tiresias_row(header: Sequence[str], source: str) -> Callable[[Row, str], TraceJob]:
    _need_columns(header, TIRESIAS_COLUMNS, source, "tiresias")

    def parse(row: Row, where: str) -> TraceJob:
        iterations = _int(row, "iterations", where, low=1)
        duration = _float(row, "duration", where, low=0.0, strict=True)
        model = row["model_name"]
        if not model:
            raise TraceError(f"{where}: model_name is empty")
        size = model_size(model)
        return TraceJob(
            job_id=_int(row, "job_id", where, low=0),
            submit_s=_float(row, "submit_time", where, low=0.0),
            iterations=iterations,
            iter_s=duration / iterations,
            persistent_bytes=size.persistent_bytes,
            ephemeral_bytes=size.ephemeral_bytes,
            gang=_int(row, "num_gpu", where, low=1),
            model=model,
        )

    return parse


def _int(row: Row, col: str, where: str, *, low: int) -> int:
    raw = row[col]
    try:
        value = int(raw)
    except ValueError:
        raise TraceError(f"{where}: column {col}: {raw!r} is not an integer") from None
    if value < low:
        raise TraceError(f"{where}: column {col}: {value} must be >= {low}")
    return value


def _float(
    row: Row,
    col: str,
    where: str,
    *,
    low: float,
    strict: bool = False,
    high: float | None = None,
    default: float | None = None,
) -> float:
    raw = row.get(col, "")
    if raw == "" and default is not None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{where}: column {col}: {raw!r} is not a number") from None
    if not math.isfinite(value) or value < low or (strict and value == low):
        raise TraceError(f"{where}: column {col}: {value} must be {'>' if strict else '>='} {low}")
    if high is not None and value > high:
        raise TraceError(f"{where}: column {col}: {value} must be <= {high}")
    return value


def to_native_csv(jobs: Iterable[TraceJob]) -> str:
    """The jobs as native CSV text (one device each: gang jobs cannot be written)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*NATIVE_COLUMNS, *NATIVE_OPTIONAL])
    for j in jobs:
        if j.gang != 1:
            raise ValueError(f"job {j.job_id}: the native format has no gang jobs (gang {j.gang})")
        writer.writerow([
            j.job_id, repr(j.submit_s), j.iterations, repr(j.iter_s),
            repr(j.persistent_bytes / MIB), repr(j.ephemeral_bytes / MIB),
            repr(j.util), repr(j.priority),
        ])
    return out.getvalue()


def synthetic(
    n_jobs: int,
    *,
    seed: int = 0,
    devices: int = 1,
    load: float = 0.9,
    short_frac: float = 0.8,
    short_iterations: tuple[int, int] = (20, 200),
    long_iterations: tuple[int, int] = (1000, 5000),
    iter_s: tuple[float, float] = (0.05, 0.5),
    utils: Sequence[float] = (0.25, 0.5, 0.75, 1.0),
    burst: bool = False,
    models: Sequence[str] | None = None,
) -> list[TraceJob]:
    """A mix of short and long training jobs over `models` (default: every model of
    `model_sizes`; the model sets a job's memory).

    Iterations are uniform in `short_iterations` (a share `short_frac` of the jobs) or
    `long_iterations`, seconds per iteration uniform in `iter_s`, util drawn from `utils`.
    Arrivals are Poisson at the rate that offers `load` x `devices` of exclusive work per second
    (so load 1.0 keeps every device of a FIFO cluster busy), or all at 0 with `burst`.
    """
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
    if devices < 1 or load <= 0:
        raise ValueError(f"devices must be >= 1 and load > 0, got {devices} and {load}")
    if not 0.0 <= short_frac <= 1.0:
        raise ValueError(f"short_frac must be in [0, 1], got {short_frac}")
    if not utils or any(not 0.0 < u <= 1.0 for u in utils):
        raise ValueError(f"utils must be in (0, 1], got {list(utils)}")
    unknown = sorted(set(models or ()) - set(MODEL_SIZES))
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {', '.join(sorted(MODEL_SIZES))}")
    rng = random.Random(seed)
    names = sorted(models or MODEL_SIZES)
    util_choices = list(utils)
    drawn = []
    for _ in range(n_jobs):
        span = short_iterations if rng.random() < short_frac else long_iterations
        drawn.append((rng.randint(*span), rng.uniform(*iter_s), rng.choice(names),
                      rng.choice(util_choices)))
    mean_s = sum(n * s for n, s, _, _ in drawn) / n_jobs
    rate = load * devices / mean_s
    t = 0.0
    jobs = []
    for i, (n, s, model, util) in enumerate(drawn):
        if not burst and i:
            t += rng.expovariate(rate)
        size = MODEL_SIZES[model]
        jobs.append(TraceJob(i, t, n, s, size.persistent_bytes, size.ephemeral_bytes, util,
                             model=model))
    return jobs
