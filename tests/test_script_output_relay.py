"""`salusd run` relays its script's output and copies it to the job's output file: `salusd logs
JOB` shows what a `salusd run` job printed, as it does for a REST script job, while the script
sees what a direct run sees (a terminal where there is one, its size, a pipe otherwise).

Expected values come from running the same script directly, under the same kind of stdout."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import salusd

from salus.daemon.state.job_output import MAX_FILE_BYTES

# Without COLUMNS and LINES, which shutil.get_terminal_size would take over the terminal's size.
ENV = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
       "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 120
PRINTS = textwrap.dedent("""\
    import os, shutil, subprocess, sys
    print("isatty", sys.stdout.isatty(), sys.stderr.isatty(), flush=True)
    print("size", tuple(shutil.get_terminal_size((0, 0))), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    os.write(1, b"raw\\r\\nbytes\\rover\\n")
    subprocess.run(["echo", "from a child"])
    print("progress 50%", end="\\r", flush=True)
    print("progress 100%")
    sys.exit(3)
""")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("salusd")
    with salusd(tmp, devices=1) as (_, address):
        yield address, tmp / "state"


def _run_argv(address: str, *argv: str) -> list[str]:
    return [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
            address.removeprefix("unix://"), "--", sys.executable, *argv]


def _logs(address: str, job: int) -> bytes:
    out = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "logs", str(job),
                          "--socket", address.removeprefix("unix://")],
                         env=ENV, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _last_job(state: Path) -> int:
    return max(int(p.name) for p in (state / "checkpoints").iterdir() if p.name.isdigit())


def _under_pty(argv: list[str], cwd: Path, rows: int = 33, cols: int = 101,
               resize: tuple[int, int] | None = None) -> tuple[int, bytes]:
    """`argv` with a new pseudo-terminal of `rows` x `cols` as stdin, stdout and stderr; its
    status and all it wrote there. `resize`: once it wrote a line, the terminal is resized to
    that and the process gets SIGWINCH (as a terminal emulator does)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=ENV)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer is gone
            break
        if not chunk:
            break
        out += chunk
        if resize is not None and b"\n" in out:
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", *resize, 0, 0))
            proc.send_signal(signal.SIGWINCH)
            resize = None
    os.close(master)
    return proc.wait(timeout=TIMEOUT_S), out


def _script_bytes(terminal: bytes) -> bytes:
    """What the script wrote, from what a terminal (with `onlcr`) got: each `\\n` came with
    one `\\r` put before it."""
    return terminal.replace(b"\r\n", b"\n")


def test_a_piped_runs_output_is_relayed_and_kept_for_salusd_logs(
        daemon: tuple[str, Path], tmp_path: Path) -> None:
    address, state = daemon
    (tmp_path / "prints.py").write_text(PRINTS)
    direct = subprocess.run([sys.executable, "prints.py"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    run = subprocess.run(_run_argv(address, "prints.py"), cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    assert (run.returncode, run.stdout) == (direct.returncode, direct.stdout) == (
        3, direct.stdout)
    assert b"isatty False False" in direct.stdout
    assert _logs(address, _last_job(state)) == direct.stdout


def test_on_a_terminal_the_script_gets_one_of_its_size(daemon: tuple[str, Path],
                                                      tmp_path: Path) -> None:
    address, state = daemon
    (tmp_path / "prints.py").write_text(PRINTS)
    status, direct = _under_pty([sys.executable, "prints.py"], tmp_path)
    assert status == 3 and b"isatty True True" in direct and b"size (101, 33)" in direct
    status, run = _under_pty(_run_argv(address, "prints.py"), tmp_path)
    assert (status, run) == (3, direct)  # byte for byte: the \r of onlcr is put once
    log = _logs(address, _last_job(state))
    assert log == _script_bytes(direct)
    assert b"raw\r\nbytes\rover\n" in log and b"progress 50%\rprogress 100%\n" in log


def test_a_resized_terminal_is_seen_by_the_script(daemon: tuple[str, Path],
                                                  tmp_path: Path) -> None:
    address, _ = daemon
    (tmp_path / "size.py").write_text(textwrap.dedent("""\
        import os, time
        print("first", os.get_terminal_size(1), flush=True)
        deadline = time.monotonic() + 60
        while os.get_terminal_size(1).columns == 101 and time.monotonic() < deadline:
            time.sleep(0.01)
        print("then", os.get_terminal_size(1), flush=True)
    """))
    status, out = _under_pty(_run_argv(address, "size.py"), tmp_path, resize=(40, 132))
    assert status == 0, out
    assert b"first os.terminal_size(columns=101, lines=33)" in out
    assert b"then os.terminal_size(columns=132, lines=40)" in out


@pytest.mark.slow
def test_the_copy_is_rotated_as_a_rest_jobs_log(daemon: tuple[str, Path],
                                                tmp_path: Path) -> None:
    address, state = daemon
    line = b"x" * 1023 + b"\n"
    lines = MAX_FILE_BYTES // len(line) + 256  # past one rotation, short of two
    (tmp_path / "much.py").write_text(textwrap.dedent(f"""\
        import sys
        for _ in range({lines}):
            sys.stdout.write("x" * 1023 + "\\n")
    """))
    run = subprocess.run(_run_argv(address, "much.py"), cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, timeout=TIMEOUT_S)
    assert run.returncode == 0 and run.stdout == line * lines
    folder = state / "checkpoints" / str(_last_job(state))
    older, newer = (folder / "output.log.1").read_bytes(), (folder / "output.log").read_bytes()
    assert len(older) <= MAX_FILE_BYTES and older + newer == line * lines
    assert len(newer) < MAX_FILE_BYTES


def test_a_reader_that_goes_away_ends_the_script_as_in_a_direct_run(
        daemon: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = daemon
    (tmp_path / "endless.py").write_text(textwrap.dedent("""\
        import time
        while True:
            print("line", flush=True)
            time.sleep(0.001)
    """))

    def first_line_then_close(argv: list[str]) -> int:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"line\n"
        proc.stdout.close()  # as `| head -1` does
        return proc.wait(timeout=TIMEOUT_S)

    direct = first_line_then_close([sys.executable, "endless.py"])
    assert direct != 0
    assert first_line_then_close(_run_argv(address, "endless.py")) == direct
