"""Trace loading: native and Tiresias CSV, errors with line numbers, the synthetic generator."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from salus.scheduler.model_sizes import DEFAULT_SIZE, MIB, MODEL_SIZES
from salus.scheduler.traces import (
    TraceError,
    load_trace,
    parse_trace,
    synthetic,
    to_native_csv,
)

# A copy of the shared trace lives in tests/data, so a clone from anywhere tests the same.
TIRESIAS = Path(__file__).resolve().parent / "data" / "tiresias-60job.csv"

NATIVE = """job_id,submit_s,iterations,iter_s,persistent_mb,ephemeral_mb,util,priority
2,5,10,0.5,100,200,0.25,2
1,0,4,1.5,50.5,10,,
"""


def test_native_rows_sorted_by_submit_and_sizes_in_mib() -> None:
    jobs = parse_trace(NATIVE)
    assert [j.job_id for j in jobs] == [1, 2]
    first, second = jobs
    assert (first.util, first.priority) == (1.0, 1.0)  # blank optional fields take defaults
    assert first.persistent_bytes == round(50.5 * MIB)
    assert second.ephemeral_bytes == 200 * MIB
    assert (second.util, second.priority, second.duration_s) == (0.25, 2.0, 5.0)


def test_native_optional_columns_may_be_absent() -> None:
    header = "job_id,submit_s,iterations,iter_s,persistent_mb,ephemeral_mb\n"
    jobs = parse_trace(header + "0,0,1,1,1,1\n")
    assert jobs[0].util == 1.0 and jobs[0].gang == 1


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("3,0,ten,1,1,1,1,1", r"<trace>:3: column iterations: 'ten' is not an integer"),
        ("3,0,0,1,1,1,1,1", r"<trace>:3: column iterations: 0 must be >= 1"),
        ("3,0,1,0,1,1,1,1", r"<trace>:3: column iter_s: 0.0 must be > 0"),
        ("3,0,1,1,1,1,1.5,1", r"<trace>:3: column util: 1.5 must be <= 1"),
        ("3,0,1,1,-2,1,1,1", r"<trace>:3: column persistent_mb: -2.0 must be >= 0"),
        ("3,nan,1,1,1,1,1,1", r"<trace>:3: column submit_s"),
        ("3,0,1,1,1", r"<trace>:3: 5 fields, the header has 8"),
        ("2,0,1,1,1,1,1,1", r"<trace>:3: job_id 2 repeats line 2"),
    ],
)
def test_native_bad_rows_name_line_and_column(row: str, message: str) -> None:
    text = NATIVE.splitlines()[0] + "\n" + NATIVE.splitlines()[1] + "\n" + row + "\n"
    with pytest.raises(TraceError, match=message):
        parse_trace(text)


def test_bad_headers_and_files() -> None:
    with pytest.raises(TraceError, match="lacks column"):
        parse_trace("job_id,submit_s\n1,2\n", "native")
    with pytest.raises(TraceError, match="unknown native column"):
        parse_trace("job_id,submit_s,iterations,iter_s,persistent_mb,ephemeral_mb,gpu\n")
    with pytest.raises(TraceError, match="no jobs"):
        parse_trace("job_id,submit_s,iterations,iter_s,persistent_mb,ephemeral_mb\n")
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace("/nonexistent/trace.csv")


def test_tiresias_trace_maps_models_and_gangs() -> None:
    jobs = load_trace(TIRESIAS)  # format detected from the header
    with TIRESIAS.open() as f:
        rows = {int(r["job_id"]): r for r in csv.DictReader(f)}
    assert len(jobs) == len(rows) == 60
    for j in jobs:
        row = rows[j.job_id]
        assert j.gang == int(row["num_gpu"])
        assert j.iterations == int(row["iterations"])
        assert j.duration_s == pytest.approx(float(row["duration"]))
        size = MODEL_SIZES.get(row["model_name"], DEFAULT_SIZE)
        assert (j.persistent_bytes, j.ephemeral_bytes) == (size.persistent_bytes,
                                                           size.ephemeral_bytes)
        # Every modelled job fits a 16 GB device on its own.
        assert j.persistent_bytes + j.ephemeral_bytes <= 16 << 30
    assert {j.gang for j in jobs} == {1, 2, 4, 8}


def test_tiresias_unknown_model_gets_default_and_bad_gpu_count_fails() -> None:
    header = "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
    (job,) = parse_trace(header + "7,2,10,100,transformer_xl,50,3\n")
    assert (job.gang, job.iter_s, job.persistent_bytes) == (2, 0.5, DEFAULT_SIZE.persistent_bytes)
    with pytest.raises(TraceError, match=r":2: column num_gpu: 0 must be >= 1"):
        parse_trace(header + "7,0,10,100,vgg16,50,3\n")


def test_synthetic_mix_is_seeded_and_round_trips_through_native_csv() -> None:
    jobs = synthetic(400, seed=3, devices=4, load=0.8, utils=(0.25, 0.5))
    assert jobs == synthetic(400, seed=3, devices=4, load=0.8, utils=(0.25, 0.5))
    assert jobs != synthetic(400, seed=4, devices=4, load=0.8, utils=(0.25, 0.5))
    short = [j for j in jobs if j.iterations <= 200]
    assert 0.7 < len(short) / len(jobs) < 0.9  # 80% short by default
    assert {j.util for j in jobs} <= {0.25, 0.5}
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    # Offered load: total exclusive work over the arrival span, per device, is near `load`.
    work = sum(j.duration_s for j in jobs)
    assert 0.5 < work / (jobs[-1].submit_s * 4) < 1.2
    back = parse_trace(to_native_csv(jobs))
    assert [(j.job_id, j.iterations, j.util) for j in back] == [
        (j.job_id, j.iterations, j.util) for j in jobs
    ]
    assert all(abs(a.iter_s - b.iter_s) < 1e-12 for a, b in zip(back, jobs, strict=True))
    burst = synthetic(10, burst=True)
    assert {j.submit_s for j in burst} == {0.0}
    with pytest.raises(ValueError, match="utils"):
        synthetic(10, utils=(0.0,))
