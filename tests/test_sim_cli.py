"""`python -m salus.scheduler.sim`: JSON, comparison table, plot, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from salus.scheduler.policies import POLICIES
from salus.scheduler.sim import main
from salus.scheduler.traces import synthetic, to_native_csv

REQUIRED = {"policy", "jobs", "avg_jct_s", "p50_jct_s", "p95_jct_s", "makespan_s",
            "avg_queue_s", "device_utilisation"}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "mix.csv"
    path.write_text(to_native_csv(synthetic(40, seed=2, devices=2, load=1.1)))
    return path


def test_json_for_one_policy(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(trace), "--policy", "srtf", "--devices", "2", "--json",
                 "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out.keys() >= REQUIRED
    assert (out["policy"], out["jobs"], out["devices"]) == ("srtf", 40, 2)
    assert out["p50_jct_s"] <= out["p95_jct_s"] <= out["max_jct_s"]
    assert 0 < out["device_utilisation"] <= 1


def test_compare_json_holds_every_policy_and_ratios(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--trace", str(trace), "--compare", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == set(POLICIES)
    for name, summary in out["policies"].items():
        assert summary.keys() >= REQUIRED
        ratio = out["ratio_to_fifo"][name]["avg_jct_s"]
        assert ratio == pytest.approx(summary["avg_jct_s"] / out["policies"]["fifo"]["avg_jct_s"])


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
