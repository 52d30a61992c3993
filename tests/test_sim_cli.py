"""`python -m salus.scheduler.sim`: JSON (against schedules worked out by hand), comparison
table, plot, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from salus.scheduler.policies import POLICIES
from salus.scheduler.sim_cli import main
from salus.scheduler.traces import synthetic, to_native_csv

REQUIRED = {"policy", "jobs", "avg_jct_s", "p50_jct_s", "p95_jct_s", "makespan_s",
            "avg_queue_s", "device_utilisation"}

# Three jobs on one device, small enough that every policy admits all of them at once:
# A from 0 s, 10 iterations of 1 s; B from 1 s, 2 of 1 s; C from 2 s, 4 of 0.5 s.
TINY = """job_id,submit_s,iterations,iter_s,persistent_mb,ephemeral_mb
1,0,10,1.0,1,1
2,1,2,1.0,1,1
3,2,4,0.5,1,1
"""
# Each policy's schedule worked out by hand: (JCT of A, B, C), (queueing of A, B, C), seconds.
HAND = {
    # A 0-10, B 10-12, C 12-14.
    "fifo": ((10.0, 11.0, 12.0), (0.0, 9.0, 10.0)),
    # B (2 s left) preempts A (9 s) at 1 and runs 1-3; C (2 s) beats B (1 s) only after B ends:
    # C 3-5; A 5-14.
    "srtf": ((14.0, 2.0, 3.0), (0.0, 0.0, 1.0)),
    # Least attained first, ties to the earlier submit: A 0-1, B 1-2, C 2-3 (two iterations),
    # A 3-4, B 4-5 (done), C 5-6 (done), A 6-14.
    "fair": ((14.0, 4.0, 4.0), (0.0, 0.0, 0.0)),
    # One lane each, all at rate 1/(jobs running): A alone to 1; A, B at 1/2 to 2; all three at
    # 1/3 until B's last 1.5 s are done at 6.5 (C has 0.5 s left); A, C at 1/2 to 7.5; A to 14.
    "pack": ((14.0, 5.5, 5.5), (0.0, 0.0, 0.0)),
}


def _percentile(sorted_values: list[float], q: float) -> float:
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _expected(policy: str) -> dict[str, float]:
    jcts, queues = HAND[policy]
    xs = sorted(jcts)
    return {"avg_jct_s": sum(jcts) / 3, "p50_jct_s": _percentile(xs, 50),
            "p95_jct_s": _percentile(xs, 95), "max_jct_s": xs[-1],
            "makespan_s": 14.0,  # every policy keeps the device busy from 0 s until 14 s
            "avg_queue_s": sum(queues) / 3, "device_utilisation": 1.0}


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.csv"
    path.write_text(TINY)
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "mix.csv"
    path.write_text(to_native_csv(synthetic(40, seed=2, devices=2, load=1.1)))
    return path


def test_json_for_one_policy(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(tiny), "--policy", "srtf", "--devices", "1", "--json",
                 "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out.keys() >= REQUIRED
    assert (out["policy"], out["jobs"], out["devices"]) == ("srtf", 3, 1)
    assert {k: out[k] for k in _expected("srtf")} == pytest.approx(_expected("srtf"))


def test_compare_json_matches_schedules_worked_out_by_hand(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--trace", str(tiny), "--compare", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == set(POLICIES) == set(HAND)
    fifo = _expected("fifo")
    for name, summary in out["policies"].items():
        assert summary.keys() >= REQUIRED
        want = _expected(name)
        assert {k: summary[k] for k in want} == pytest.approx(want), name
        assert out["ratio_to_fifo"][name] == pytest.approx(
            {k: want[k] / fifo[k] for k in out["ratio_to_fifo"][name]}), name


def test_compare_table_and_plot(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "cdf.png"
    assert main(["--trace", str(trace), "--compare", "--plot", str(png), "--quiet"]) == 0
    table = capsys.readouterr().out
    for name in POLICIES:
        assert name in table
    assert "x fifo" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_are_one_line_with_exit_status_2(
    tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("job_id,submit_s,iterations,iter_s,persistent_mb,ephemeral_mb\n1,0,x,1,1,1\n")
    assert main(["--trace", str(bad), "--quiet"]) == 2
    assert f"error: {bad}:2: column iterations: 'x' is not an integer" in capsys.readouterr().err
    assert main(["--trace", str(trace), "--device-memory-mb", "64", "--quiet"]) == 2
    assert "raise the device memory" in capsys.readouterr().err


def test_module_runs_as_a_command(trace: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "salus.scheduler.sim", "--trace", str(trace), "--policy", "pack",
         "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policy"] == "pack"
