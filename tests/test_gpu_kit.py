"""The GPU acceptance kit's CPU path (`bash bench/gpu/run.sh --cpu`): it exits 0 and writes one
JSON file whose every step is figures, {"skipped": why} or {"error": text}; every figure carries
its goal and whether it was met, and the verdict counts them. Five quick steps run; the others
must say they were not chosen."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["cuda_tests", "switch_latency", "priority_latency", "inference_memory", "faults",
         "gang", "script_job", "mstopk"]


def _figures(obj: Any) -> list[dict[str, Any]]:
    if isinstance(obj, dict) and {"value", "goal", "met"} <= obj.keys():
        return [obj]
    if isinstance(obj, dict):
        return [f for v in obj.values() for f in _figures(v)]
    return []


def _bare_numbers(obj: Any, path: str = "") -> list[str]:
    """Numbers and bools not wrapped as figures (there must be none)."""
    if isinstance(obj, dict) and {"value", "goal", "met"} <= obj.keys():
        return []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _bare_numbers(v, f"{path}.{k}")]
    return [path] if isinstance(obj, bool | int | float) else []


@pytest.mark.slow
def test_cpu_run_writes_the_kits_json(tmp_path: Path) -> None:
    chosen = "cuda_tests,switch_latency,gang,script_job,mstopk"
    done = subprocess.run(["bash", "bench/gpu/run.sh", "--cpu", str(tmp_path),
                           "--budget-s", "200", "--steps", chosen],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-kit.json").read_text())
    log = (tmp_path / "gpu-kit.log").read_text()
    machine = report["machine"]
    assert machine["mode"] == "cpu" and machine["device"] == "cpu"
    assert isinstance(machine["torch"], str) and isinstance(machine["kernel"], str)
    steps = report["steps"]
    assert list(steps) == STEPS
    for name in set(STEPS) - set(chosen.split(",")):
        assert steps[name] == {"skipped": "not among --steps"}
    for name in chosen.split(","):
        assert "error" not in steps[name], (name, steps[name], log[-3000:])
        assert report["verdict"][name]["status"] == "ok"
        assert _bare_numbers(steps[name]) == [], name
    assert all(isinstance(f["goal"], str) and f["met"] in (True, False, None)
               for f in _figures(steps))

    switch = steps["switch_latency"]
    assert switch["warm_switches"]["value"] > 10
    p50, p99 = switch["warm_switch_p50_ms"]["value"], switch["warm_switch_p99_ms"]["value"]
    assert 0 < p50 <= p99
    assert switch["warm_switch_p99_ms"]["goal"].startswith("<= 1.0 ms")
    assert switch["warm_switch_p99_ms"]["met"] is None  # a GPU goal, not judged on a CPU
    assert switch["large"]["warm_switches"]["value"] > 5
    assert switch["client_errors"] == []

    tests = steps["cuda_tests"]
    assert tests["tests_skipped"]["value"] >= 1 and tests["tests_passed"]["value"] == 0
    assert tests["tests_failed"] == {"value": 0, "goal": "0: every cuda test passes",
                                     "met": True}

    gang = steps["gang"]
    assert gang["cpu"]["equal_within_1e-5"]["met"] is True
    assert gang["cpu"]["max_abs_param_diff"]["value"] <= 1e-5
    assert set(gang["cuda"]) == {"skipped"}

    script = steps["script_job"]
    assert script["ran"]["met"] is True and script["peak_reported"]["met"] is True
    assert script["iterations_done"]["value"] == 30  # one per optimizer step

    topk = steps["mstopk"]
    assert topk["recall"]["met"] is True and topk["kernel"] == "torch"
    assert report["kit_seconds"] < 200 + 30
