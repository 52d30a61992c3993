"""The systemd unit in deploy/ is one systemd accepts (`systemd-analyze verify`), with salusd
where this checkout installed it; skipped where systemd-analyze is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "deploy" / "salusd.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    salusd = Path(sys.executable).parent / "salusd"
    assert salusd.exists(), "the package's console script is not installed beside python"
    text = UNIT.read_text().replace("/usr/local/bin/salusd", str(salusd))
    unit = tmp_path / "salusd.service"
    unit.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=120)
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if "salusd.service" in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr
    assert "User=" not in text  # root: executors drop to each job's owner (docs/runtime.md)
    assert "CAP_SETUID" in text and "CAP_SETGID" in text
