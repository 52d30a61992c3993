"""`make demo` (`python -m salus.demo`): its reduced run goes through every part and writes
the lane timeline; the timeline's intervals come from the samples as drawn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from salus.demo.timeline import Phase, intervals


def test_intervals_join_consecutive_samples_of_one_holder() -> None:
    a, b = (0, 1), (0, 2)
    phase = Phase("p", 0.0, [
        (0.0, {a: "x", b: None}),
        (0.1, {a: "x", b: "y"}),
        (0.2, {a: "z", b: "y"}),
        (0.3, {a: None, b: None}),
        (0.4, {a: "x", b: None}),
    ])
    # Each sample's holder holds the lane until the next sample; the last sample ends nothing.
    assert intervals(phase) == {
        a: [(0.0, 0.2, "x"), (0.2, 0.3, "z")],
        b: [(0.1, 0.3, "y")],
    }


@pytest.mark.slow
def test_quick_demo_runs_every_part(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "salus.demo", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=280,
        env={**os.environ, "COLUMNS": "400"},  # one line per sentence, as printed
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = proc.stdout
    for part in ("JCT of each script", "memory of 2 resident", "inference (infer-mlp",
                 "- warm start:", "- scheduling, one job at a time:", "- memory:",
                 "- priority:", "on a GPU (not measured here)"):
        assert part in text, part
    assert "every script's loss under salusd equals its plain run's (bitwise)" in text
    plot = out / "lanes.png"
    assert f"timeline of who held each lane: {plot.resolve()}" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
