"""salus.scheduler is pure Python: importing it, or running the simulator, never loads torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from salus.scheduler.traces import synthetic, to_native_csv


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("no torch")


def test_import_leaves_torch_out() -> None:
    _run("import sys, salus.scheduler\n"
         "assert 'torch' not in sys.modules, 'torch was imported'\n"
         "print('no torch')\n")


def test_simulator_run_leaves_torch_out(tmp_path: Path) -> None:
    trace = tmp_path / "mix.csv"
    trace.write_text(to_native_csv(synthetic(30, seed=2)))
    code = (
        "import sys\n"
        "import salus.scheduler, salus.scheduler.sim, salus.scheduler.report\n"
        "import salus.scheduler.traces, salus.scheduler.fairshare\n"
        "from salus.scheduler.sim_cli import main\n"
        f"main(['--trace', {str(trace)!r}, '--compare', '--quiet',"
        f" '--plot', {str(tmp_path / 'p.png')!r}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('no torch')\n"
    )
    _run(code)


