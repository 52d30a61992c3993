"""The pieces that let a script run under an interpreter without torch or salusd, each on its own:
the import hook (`executor/on_import.py`), the JSON-only channel (`wire/json_channel.py`), the
generated path directory (`python_path.py`), the interpreter checks (`executor/zygote.py`,
`zygotes.py`) and the JAX/TensorFlow memory settings (`executor/framework_memory.py`)."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from salus.daemon.executor.framework_memory import framework_memory_env
from salus.daemon.executor.on_import import when_imported
from salus.daemon.executor.zygote import too_old
from salus.daemon.python_path import PACKAGES, build
from salus.daemon.supervisor.zygotes import exited_why
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.frames import FLAG_SOCKET, ConnectionClosed, json_frame
from salus.daemon.wire.json_channel import JsonChannel

ROOT = Path(__file__).parent.parent
GiB = 1 << 30


# ---- JAX / TensorFlow memory settings ---------------------------------------------------------
def test_a_cpu_placed_script_gets_no_framework_memory_settings() -> None:
    assert framework_memory_env("cpu:0", 2 * GiB, 16 * GiB, {}) == {}
    assert framework_memory_env("cpu", 2 * GiB, None, {}) == {}


def test_a_gpu_placed_script_gets_its_budgets_fraction_unless_its_caller_set_one() -> None:
    # 3 GiB of 16 GiB is 0.1875 exactly; 1 GiB of 80e9 bytes is 0.013421..., rounded down.
    assert framework_memory_env("cuda:0", 3 * GiB, 16 * GiB, {}) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1875",
        "XLA_CLIENT_MEM_FRACTION": "0.1875", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    got = framework_memory_env("cuda:1", GiB, 80_000_000_000,
                               {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "PATH": "/bin"})
    assert got == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.0134", "XLA_CLIENT_MEM_FRACTION": "0.0134",
                   "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    assert framework_memory_env("cuda:0", 20 * GiB, 16 * GiB, {})[
        "XLA_CLIENT_MEM_FRACTION"] == "1.0000"
    assert framework_memory_env("cuda:0", GiB, None, {}) == {}  # the total is unknown


# ---- the import hook ---------------------------------------------------------------------------
def test_an_action_runs_once_the_module_is_imported_and_at_once_when_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "late_pkg").mkdir()
    (tmp_path / "late_pkg" / "__init__.py").write_text("from late_pkg import inner\nVALUE = 7\n")
    (tmp_path / "late_pkg" / "inner.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[tuple[str, int]] = []
    when_imported("late_pkg", lambda m: seen.append((m.__name__, m.VALUE)))
    assert seen == [] and "late_pkg" not in sys.modules
    module = importlib.import_module("late_pkg")
    assert seen == [("late_pkg", 7)]  # after the whole package ran, with its submodules
    assert type(module.__loader__).__name__ == "SourceFileLoader"  # its own loader kept
    assert module.__spec__ is not None and module.__spec__.loader is module.__loader__
    when_imported("late_pkg", lambda m: seen.append(("again", m.VALUE)))
    assert seen[-1] == ("again", 7)
    importlib.reload(module)
    assert len(seen) == 2  # each action runs once
    del sys.modules["late_pkg"], sys.modules["late_pkg.inner"]


def test_an_action_that_fails_leaves_the_import_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "late_mod.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    when_imported("late_mod", lambda m: 1 / 0)  # type: ignore[func-returns-value]
    assert importlib.import_module("late_mod").VALUE == 3
    del sys.modules["late_mod"]


# ---- the JSON channel ------------------------------------------------------------------------
def test_the_json_channel_reads_what_the_daemon_sends_and_a_socket_frame() -> None:
    ours, theirs = socket.socketpair()
    passed, kept = socket.socketpair()
    channel = JsonChannel(theirs)
    ours.sendall(b"".join(json_frame({"op": "host", "job": 3}).buffers()))
    frame = json_frame({})
    frame.flags |= FLAG_SOCKET
    socket.send_fds(ours, [b"".join(frame.buffers())], [passed.fileno()])
    passed.close()
    assert channel.recv() == {"op": "host", "job": 3}
    message = channel.recv()
    fd = message.pop("socket_fd")
    assert message == {}
    with socket.socket(fileno=fd) as got:  # the same connection: what one end sends arrives
        got.sendall(b"ping")
        assert kept.recv(4) == b"ping"
    channel.send({"op": "ack", "job": 3})
    assert Channel(ours).recv() == {"op": "ack", "job": 3}  # the general channel reads it
    ours.close()
    with pytest.raises(ConnectionClosed):
        channel.recv()
    kept.close()
    theirs.close()


# ---- the generated path directory --------------------------------------------------------------
def test_the_path_holds_every_salus_package_pyproject_maps_and_the_metadata(
        tmp_path: Path) -> None:
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    assert sorted(f"salus.{name}" for name in PACKAGES) == sorted(mapped)
    (tmp_path / "path").mkdir()
    where = build(tmp_path / "path")
    for name, folder in mapped.items():
        link = where / "salus" / name.removeprefix("salus.")
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve()
    meta = [p for p in where.iterdir() if p.name.endswith((".dist-info", ".egg-info"))]
    assert len(meta) == 1, list(where.iterdir())
    assert sorted(p.name for p in where.iterdir()) == sorted(["salus", meta[0].name])
    # Another interpreter with only this directory on its path imports salusd's executor
    # code under its package names and reads its version, and no torch.
    code = textwrap.dedent("""\
        import importlib.metadata, sys
        import salus.daemon.executor.script_only, salus.adapters.script
        print(importlib.metadata.version("salusd"), "torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(where), "PATH": os.defpath}, timeout=60,
                          cwd=tmp_path)
    assert done.stdout.split() == [importlib.metadata.version("salusd"), "False"], done.stderr


# ---- what cannot run, in one line ------------------------------------------------------------
def test_an_interpreter_before_python_3_11_is_refused_in_one_line() -> None:
    assert too_old("/venv/bin/python", (3, 11, 0)) == ""
    assert too_old("/venv/bin/python", (3, 13, 1)) == ""
    assert too_old("/old/bin/python", (3, 9, 18)) == (
        "/old/bin/python is Python 3.9.18; salusd runs scripts with Python 3.11 or later")


def test_an_interpreter_that_exits_says_its_last_line_or_its_status() -> None:
    assert exited_why("/v/bin/python", False, "SyntaxError: invalid syntax", 1) == (
        "/v/bin/python exited before it could run the script: SyntaxError: invalid syntax")
    assert exited_why("/v/bin/python", False, "", 127) == (
        "/v/bin/python exited before it could run the script (exit status 127)")
    assert exited_why("/v/bin/python", True, "a job's own line", None) == (
        "/v/bin/python exited while salusd was running scripts with it")
    assert exited_why("/v/bin/python", True, "a job's own line", -9) == (
        "/v/bin/python exited while salusd was running scripts with it (signal 9)")
