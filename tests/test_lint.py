"""The house rules `make test` checks too: ruff and mypy clean over the package code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_ruff_is_clean() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_is_clean(tmp_path: Path) -> None:
    result = _run("mypy", "--cache-dir", str(tmp_path), "salusd", "scheduler", "adapters")
    assert result.returncode == 0, result.stdout + result.stderr
