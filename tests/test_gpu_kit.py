"""The GPU acceptance kit's CPU path (`bash bench/gpu/run.sh --cpu`): it exits 0 and writes one
JSON file whose every step is figures, {"skipped": why} or {"error": text}, with the figures a
CPU can measure as numbers. Three quick steps run; the others must say they were not chosen."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["cuda_tests", "switch_latency", "priority_latency", "inference_memory", "faults",
         "gang"]


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@pytest.mark.slow
def test_cpu_run_writes_the_kits_json(tmp_path: Path) -> None:
    chosen = "cuda_tests,switch_latency,gang"
    done = subprocess.run(["bash", "bench/gpu/run.sh", "--cpu", str(tmp_path),
                           "--budget-s", "150", "--steps", chosen],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-kit.json").read_text())
    assert (tmp_path / "gpu-kit.log").exists()
    machine = report["machine"]
    assert machine["mode"] == "cpu" and machine["device"] == "cpu"
    assert isinstance(machine["torch"], str)
    steps = report["steps"]
    assert list(steps) == STEPS
    for name in set(STEPS) - set(chosen.split(",")):
        assert steps[name] == {"skipped": "not among --steps"}
    log = (tmp_path / "gpu-kit.log").read_text()
    for name in chosen.split(","):
        assert "error" not in steps[name], (name, steps[name], log[-3000:])

    switch = steps["switch_latency"]
    assert switch["warm_switches"] > 10
    assert 0 < switch["warm_switch_p50_ms"] <= switch["warm_switch_p99_ms"]
    assert switch["after_swap_resume_to_call_ms"] and all(
        _number(v) and v > 0 for v in switch["after_swap_resume_to_call_ms"])
    assert switch["client_errors"] == []

    tests = steps["cuda_tests"]
    assert tests["tests_skipped"] >= 1 and tests["tests_passed"] == tests["tests_failed"] == 0

    gang = steps["gang"]
    assert gang["cpu"]["equal_within_1e-5"] is True
    assert gang["cpu"]["max_abs_param_diff"] <= 1e-5
    assert set(gang["cuda"]) == {"skipped"}
