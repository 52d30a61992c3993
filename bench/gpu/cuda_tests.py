"""The project's CUDA tests: `pytest -m cuda` over the test files that mark some, with counts
of passed, failed and skipped tests and the failures' names (from pytest's JUnit XML); a file
that fails to import counts as a failure. Without CUDA they all skip, which a CPU run reports."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import kit

# pytest's limit: 10 s inside the step's own (run.py passes it), so its counts come back
LIMIT_S = float(os.environ.get("SALUS_KIT_STEP_LIMIT_S", "160")) - 10


def measure(cpu: bool) -> dict[str, Any]:
    root = kit.BENCH.parent
    # Only the files with CUDA tests: the others may import what a GPU machine lacks.
    files = sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py")
                   if "mark.cuda" in p.read_text())
    if not files:
        return kit.skipped("no test under tests/ is marked cuda")
    with tempfile.TemporaryDirectory(prefix="salusd-kit-pytest-") as tmp:
        report = Path(tmp) / "junit.xml"
        # pytest-timeout comes from .whl/ where the machine lacks it; without it, no limit
        timeout = ["--timeout=60"] if importlib.util.find_spec("pytest_timeout") else []
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
               *timeout, "--continue-on-collection-errors", f"--junitxml={report}", *files]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if cpu else None
        try:
            done = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                                  timeout=LIMIT_S, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"pytest -m cuda ran past {LIMIT_S:.0f} s"}
        if not report.exists():
            return {"error": f"pytest exited {done.returncode} without a report: "
                             f"{(done.stdout + done.stderr)[-2000:]}"}
        cases = ET.parse(report).getroot().iter("testcase")
        outcome: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
        for case in cases:
            name = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            key = ("failed" if kinds & {"failure", "error"} else
                   "skipped" if "skipped" in kinds else "passed")
            outcome[key].append(name)
    return {
        "command": " ".join(a for a in cmd[2:] if not a.startswith("--junitxml")),
        "exit_code": done.returncode,
        "tests_passed": len(outcome["passed"]),
        "tests_failed": len(outcome["failed"]),
        "tests_skipped": len(outcome["skipped"]),
        "failures": outcome["failed"],
        "summary": "".join(done.stdout.strip().splitlines()[-1:]),
    }


def main() -> None:
    args = kit.arguments(__doc__.splitlines()[0])
    kit.emit(measure(args.cpu))


if __name__ == "__main__":
    main()
