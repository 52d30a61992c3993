"""`salusd run -- /other/venv/bin/python script.py` where that environment has neither torch nor
salusd (issue 32 §3): the script runs in an executor of its own interpreter, with the daemon's
salusd packages and nothing else of the daemon's on its path (`salusd/python_path.py`).

Every expected output comes from running the same script directly with the same interpreter.
The environments are `python -m venv --without-pip` ones; numpy, where a test needs it, is the
daemon environment's package linked into the new one's site-packages, and torch is asserted
not to be importable there.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from daemon_proc import salusd
from test_script_jobs import _ended_job

from salus.daemon.cli.control import Control

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 120
GiB = 1 << 30


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("salusd")
    with salusd(tmp, "--policy", "fair", devices=1, memory="2G") as (_, address):
        yield address


def bare_venv(where: Path, *, numpy: bool = False) -> Path:
    """A virtualenv without pip, torch or salusd (with `numpy`: the daemon environment's numpy
    linked in); its python. Asserts that neither torch nor salus can be imported there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=TIMEOUT_S)
    python = where / "bin" / "python"
    site = Path(_output(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    if numpy:
        ours = Path(np.__file__).parent.parent
        for name in ("numpy", "numpy.libs"):
            if (ours / name).exists():
                (site / name).symlink_to(ours / name, target_is_directory=True)
    found = _output(python, "import importlib.util as u; "
                            "print([u.find_spec(m) is None for m in ('torch', 'salus')])")
    assert found == "[True, True]", found
    return python


def _output(python: Path, code: str) -> str:
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True,
                          timeout=TIMEOUT_S, env=ENV)
    return done.stdout.strip()


def under_salusd(address: str, python: Path, argv: list[str], cwd: Path, *options: str,
                 stdin: str | None = None, env: dict[str, str] | None = None
                 ) -> tuple[int, str, str]:
    """`salusd run [options] -- PYTHON ARGV...` in `cwd`: (exit status, stdout, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
         address.removeprefix("unix://"), *options, "--", str(python), *argv],
        cwd=cwd, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S,
        env=env or ENV)
    return done.returncode, done.stdout, done.stderr


def directly(python: Path, argv: list[str], cwd: Path, stdin: str | None = None
             ) -> tuple[int, str, str]:
    done = subprocess.run([str(python), *argv], cwd=cwd, input=stdin, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=ENV)
    return done.returncode, done.stdout, done.stderr


def script(tmp_path: Path, body: str, name: str = "s.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def info(address: str, name: str) -> dict[str, Any]:
    with Control(address) as ctl:
        return _ended_job(ctl, name)


@pytest.mark.slow
def test_a_numpy_script_in_a_venv_without_torch_or_salusd_prints_its_direct_runs_output(
        daemon: str, tmp_path: Path) -> None:
    """It runs as one iteration (no torch, no boundary), and nothing imported torch."""
    python = bare_venv(tmp_path / "venv", numpy=True)
    path = script(tmp_path, """\
        import sys
        import numpy as np
        rng = np.random.default_rng(7)
        a = rng.standard_normal((6, 6))
        print(np.linalg.eigvalsh(a @ a.T).round(10).tolist())
        print(np.__file__.startswith(sys.prefix), "torch" in sys.modules, sys.prefix)
        print(sys.argv[1:])
    """)
    want = directly(python, [str(path), "x", "--y"], tmp_path)
    assert want[0] == 0 and want[1].splitlines()[1].startswith("True False"), want
    got = under_salusd(daemon, python, [str(path), "x", "--y"], tmp_path, "--name", "numpy")
    assert got == want
    assert info(daemon, "numpy")["iterations_done"] == 1


@pytest.mark.slow
def test_a_stdlib_script_in_a_bare_venv_reads_stdin_and_exits_as_directly(
        daemon: str, tmp_path: Path) -> None:
    python = bare_venv(tmp_path / "bare")
    path = script(tmp_path, """\
        import hashlib, os, sys
        data = sys.stdin.read()
        print(hashlib.sha256(data.encode()).hexdigest(), sys.prefix, os.getcwd())
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    """)
    want = directly(python, [str(path)], tmp_path, stdin="some input\n")
    assert want[0] == 3 and want[2] == "to stderr\n", want
    assert under_salusd(daemon, python, [str(path)], tmp_path, stdin="some input\n") == want


@pytest.mark.slow
def test_boundaries_without_torch_and_once_the_script_imports_it(
        daemon: str, tmp_path: Path) -> None:
    """`salus.adapters.script.step()` marks boundaries where there is no torch; where the
    script imports torch itself (here from the caller's PYTHONPATH, which the interpreter's
    own environment lacks), every optimizer step is one from then on, and torch runs the
    daemon's one intra-op thread."""
    python = bare_venv(tmp_path / "bare")
    steps = script(tmp_path, """\
        import salus.adapters.script as salus
        for _ in range(3):
            salus.step()
        print(salus.under_salusd())
    """, "steps.py")
    code, out, err = under_salusd(daemon, python, [str(steps)], tmp_path, "--name", "steps")
    assert (code, out) == (0, "True\n"), err
    assert info(daemon, "steps")["iterations_done"] == 3
    late = script(tmp_path, """\
        import sys
        print("torch" in sys.modules)
        import torch
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        for _ in range(4):
            opt.step()
        print(torch.get_num_threads())
    """, "late.py")
    path_env = {**ENV, "PYTHONPATH": sysconfig.get_paths()["purelib"], "OMP_NUM_THREADS": "2"}
    code, out, err = under_salusd(daemon, python, [str(late)], tmp_path, "--name", "late",
                                  env=path_env)
    assert (code, out) == (0, "False\n1\n"), err
    assert info(daemon, "late")["iterations_done"] == 4


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "log" not in lines[0] and "zygote" not in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
def test_an_interpreter_that_cannot_run_the_script_is_refused_in_one_line(
        daemon: str, tmp_path: Path) -> None:
    """Another salusd version found before the daemon's (a `.pth` of that environment puts it
    first), and a `python` that is no Python interpreter, each named with what is wrong."""
    python = bare_venv(tmp_path / "other")
    site = Path(_output(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    other = tmp_path / "other-salusd"
    (other / "salusd-9.9.9.dist-info").mkdir(parents=True)
    (other / "salusd-9.9.9.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: salusd\nVersion: 9.9.9\n")
    (site / "first.pth").write_text(f"import sys; sys.path.insert(0, {str(other)!r})\n")
    path = script(tmp_path, "print('ran')\n")
    code, out, err = under_salusd(daemon, python, [str(path)], tmp_path)
    ours = importlib.metadata.version("salusd")
    assert (code, out) == (125, ""), err
    assert f"{python} finds salusd 9.9.9 where this salusd runs {ours}" in _one_line(err)

    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True)
    (fake / "pyvenv.cfg").write_text("home = /nowhere\n")
    (fake / "bin" / "python").write_text("#!/bin/sh\necho 'this is not Python' >&2\nexit 3\n")
    (fake / "bin" / "python").chmod(0o755)
    code, out, err = under_salusd(daemon, fake / "bin" / "python", [str(path)], tmp_path)
    assert (code, out) == (125, ""), err
    assert (f"{fake / 'bin' / 'python'} exited before it could run the script: this is not "
            "Python") in _one_line(err)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                    reason="JAX is not installed (the test extra installs jax[cpu])")
def test_a_jax_script_prints_its_direct_runs_output(daemon: str, tmp_path: Path) -> None:
    """A JAX script's results under salusd equal a direct run's (on the CPU here)."""
    path = script(tmp_path, """\
        import jax, jax.numpy as jnp
        x = jax.random.normal(jax.random.PRNGKey(0), (8, 8))
        print(jnp.linalg.norm(x @ x.T).item(), jax.devices()[0].platform)
    """)
    python = Path(sys.executable)
    want = directly(python, [str(path)], tmp_path)
    assert want[0] == 0, want
    assert under_salusd(daemon, python, [str(path)], tmp_path)[:2] == want[:2]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_script_on_a_gpu_finds_jax_and_tensorflow_held_to_its_budget(tmp_path: Path) -> None:
    """The budget's fraction of the GPU (2 GiB asked with --mem), computed here from torch's
    view of the device; a variable the caller set is the caller's."""
    path = script(tmp_path, """\
        import json, os
        names = ["XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "XLA_CLIENT_MEM_FRACTION", "TF_FORCE_GPU_ALLOW_GROWTH"]
        print(json.dumps({n: os.environ.get(n) for n in names}))
    """)
    env = {**ENV, "XLA_CLIENT_MEM_FRACTION": "0.5"}
    with salusd(tmp_path, gpus=True) as (_, address):
        code, out, err = under_salusd(address, Path(sys.executable), [str(path)], tmp_path,
                                      "--mem", "2G", env=env)
    assert code == 0, err
    got = json.loads(out)
    share = 2 * GiB / torch.cuda.get_device_properties(0).total_memory
    assert got.pop("XLA_CLIENT_MEM_FRACTION") == "0.5"
    assert abs(float(got.pop("XLA_PYTHON_CLIENT_MEM_FRACTION")) - share) < 1e-3
    assert got == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
