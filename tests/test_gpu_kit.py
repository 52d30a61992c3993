"""The GPU acceptance kit's CPU path (`bash bench/gpu/run.sh --cpu`): it exits 0 and writes one
JSON file whose every step is figures, {"skipped": why} or {"error": text}; every figure carries
its value, unit, goal and whether it was met, and the verdict counts them. Five quick steps run
(the slow test); the others must say they were not chosen. The goals themselves
(bench/gpu/goals.py) are checked on hand-made results, without running anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import goals  # noqa: E402 - bench/gpu is not a package

STEPS = ["cuda_tests", "switch_latency", "priority_latency", "inference_memory", "faults",
         "gang", "script_job", "mstopk", "mps_facts"]
FIGURE = {"value", "unit", "goal", "met"}


def _figures(obj: Any) -> list[dict[str, Any]]:
    if isinstance(obj, dict) and obj.keys() >= FIGURE:
        return [obj]
    if isinstance(obj, dict):
        return [f for v in obj.values() for f in _figures(v)]
    return []


def _bare_numbers(obj: Any, path: str = "") -> list[str]:
    """Numbers and bools not wrapped as figures (there must be none)."""
    if isinstance(obj, dict) and obj.keys() >= FIGURE:
        return []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _bare_numbers(v, f"{path}.{k}")]
    return [path] if isinstance(obj, bool | int | float) else []


def test_goals_judge_figures_on_a_gpu_run_and_leave_gpu_goals_open_on_a_cpu_run() -> None:
    result = {"warm_switch_p99_ms": 0.4, "same_job_gap_p50_ms": 0.2,
              "large": {"warm_switch_p99_ms": 2.5},
              "two_owners": {"both_trained": True, "warm_switch_p99_ms": None},
              "device": "cuda:0", "sizes": [1, 2]}
    gpu = goals.judge("switch_latency", result, cuda=True)
    assert gpu["warm_switch_p99_ms"] == {"value": 0.4, "unit": "ms",
                                         "goal": "<= 1.0 ms (PipeSwitch 3.6-6.6 ms)",
                                         "met": True}
    assert gpu["large"]["warm_switch_p99_ms"]["met"] is False
    assert gpu["same_job_gap_p50_ms"]["goal"] == "recorded: no goal"
    assert gpu["same_job_gap_p50_ms"]["met"] is None
    assert gpu["two_owners"]["both_trained"]["unit"] == "bool"
    # a goal's figure that was not measured is missed on a GPU, open on a CPU run
    assert gpu["two_owners"]["warm_switch_p99_ms"]["met"] is False
    assert gpu["two_owners"]["warm_switch_p99_ms"]["why"] == "not measured"
    assert gpu["device"] == "cuda:0" and gpu["sizes"]["unit"] == "count"
    cpu = goals.judge("switch_latency", result, cuda=False)
    assert cpu["warm_switch_p99_ms"]["met"] is None and "why" in cpu["warm_switch_p99_ms"]
    assert cpu["two_owners"]["both_trained"]["met"] is True
    counted = goals.verdict({"switch_latency": gpu, "faults": {"error": "timed out"},
                             "gang": goals.judge("gang", {"cpu": {"equal_within_1e-5": True},
                                                          "cuda": {"skipped": "needs CUDA"},
                                                          "join": {"error": "x"}}, True)})
    assert counted["switch_latency"] == {"status": "ok", "met": 2, "missed": 2,
                                         "not_judged": 2, "case_errors": [],
                                         "cases_skipped": []}
    assert counted["faults"]["status"] == "error"
    assert counted["gang"]["met"] == 1
    assert counted["gang"]["case_errors"] == ["join"]
    assert counted["gang"]["cases_skipped"] == ["cuda"]


@pytest.mark.slow
def test_cpu_run_writes_the_kits_json(tmp_path: Path) -> None:
    chosen = "cuda_tests,inference_memory,gang,script_job,mstopk"
    done = subprocess.run(["bash", "bench/gpu/run.sh", "--cpu", str(tmp_path),
                           "--budget-s", "200", "--steps", chosen],
                          cwd=ROOT, capture_output=True, text=True, timeout=290)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-kit.json").read_text())
    log = (tmp_path / "gpu-kit.log").read_text()
    machine = report["machine"]
    assert machine["mode"] == "cpu" and machine["device"] == "cpu"
    assert isinstance(machine["torch"], str) and isinstance(machine["kernel"], str)
    assert "mps_control" in machine and "context_cost" in machine
    steps = report["steps"]
    assert list(steps) == STEPS
    for name in set(STEPS) - set(chosen.split(",")):
        assert steps[name] == {"skipped": "not among --steps"}
    for name in chosen.split(","):
        assert "error" not in steps[name], (name, steps[name], log[-3000:])
        assert report["verdict"][name]["status"] == "ok"
        assert report["verdict"][name]["case_errors"] == [], (name, steps[name])
        assert _bare_numbers(steps[name]) == [], name
    figures = _figures(steps)
    assert len(figures) > 20
    assert all(isinstance(f["goal"], str) and isinstance(f["unit"], str)
               and f["met"] in (True, False, None) for f in figures)

    tests = steps["cuda_tests"]
    assert tests["tests_skipped"]["value"] >= 1 and tests["tests_passed"]["value"] == 0
    assert tests["tests_failed"] == {"value": 0, "unit": "count",
                                     "goal": "0: every cuda test passes", "met": True}

    gang = steps["gang"]
    assert gang["cpu"]["equal_within_1e-5"]["met"] is True
    assert gang["cpu"]["max_abs_param_diff"]["value"] <= 1e-5
    assert set(gang["cuda"]) == {"skipped"}
    join = gang["nccl_join_one_replica"]
    assert join["joined"]["met"] is True and join["all_reduce_ok"]["met"] is True
    assert join["backend"] == "gloo"

    memory = steps["inference_memory"]
    assert memory["daemon_processes"]["value"] >= 2  # the daemon and its executors, read
    assert memory["processes_over_daemon_pss"]["value"] > 0

    script = steps["script_job"]
    assert script["ran"]["met"] is True and script["peak_reported"]["met"] is True
    assert script["daemon_measured_peak_bytes"]["value"] > 0
    assert script["iterations_done"]["value"] == 30  # one per optimizer step
    here = script["here"]  # the same script in salusd run's own child
    assert here["ran"]["met"] is True and here["peak_reported"]["met"] is True
    assert here["iterations_done"]["value"] == 30

    topk = steps["mstopk"]
    assert topk["recall"]["met"] is True and topk["kernel"] == "torch"
    assert topk["index_agreement"]["value"] >= 0.99
    assert report["kit_seconds"] < 150 + 30


def test_the_mps_facts_step_says_why_it_is_skipped_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, "bench/gpu/mps_facts.py", "--cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "bench" / "gpu")})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"skipped": "needs CUDA"}
